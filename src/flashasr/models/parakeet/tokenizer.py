"""Tokenizers for Parakeet: SentencePiece (NeMo ``SentencePieceTokenizer``) and a stand-in.

Text decoding follows NeMo: ``ids_to_text(ids) = sp.decode_ids(ids)``. Word boundaries are
pieces that start with the SentencePiece word marker ``▁`` (U+2581).
"""

from __future__ import annotations

from ...errors import ModelLoadError

WORD_MARKER = "\u2581"


class SentencePieceTokenizer:
    """Wraps ``sentencepiece.SentencePieceProcessor`` loaded from model bytes.

    Raises:
        ModelLoadError: the bytes are not a SentencePiece model.
    """

    def __init__(self, model_proto: bytes, source: str = "tokenizer"):
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(model_proto)
        except Exception as e:  # sentencepiece raises RuntimeError / OSError
            raise ModelLoadError(f"{source}: tokenizer model is not a SentencePiece model ({e})") from e
        self.vocab_size = int(self.sp.get_piece_size())

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode_ids([int(i) for i in ids]) if ids else ""

    def piece(self, i: int) -> str:
        return self.sp.id_to_piece(int(i))


class DummyTokenizer:
    """Stand-in for random-weight models: ``vocab_size`` pieces ``▁w<i>`` (every 4th) / ``x<i>``.

    Decoding joins pieces and turns ``▁`` into spaces (texts are meaningless by design).
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size)

    def piece(self, i: int) -> str:
        i = int(i)
        return f"{WORD_MARKER}w{i}" if i % 4 == 0 else f"x{i}"

    def decode(self, ids: list[int]) -> str:
        return "".join(self.piece(i) for i in ids).replace(WORD_MARKER, " ").strip()


__all__ = ["SentencePieceTokenizer", "DummyTokenizer", "WORD_MARKER"]
