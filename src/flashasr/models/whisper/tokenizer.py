"""Whisper tokenizer: byte-level BPE from a ``tokenizer.json`` (``tokenizers`` package) plus the
special tokens, all resolved by name from the vocabulary.

Special-token layout (a fact of every Whisper vocabulary): ``<|endoftext|>`` (eot),
``<|startoftranscript|>`` (sot), then one ``<|xx|>`` token per language (99, or 100 from large-v3
with ``<|yue|>``), ``<|translate|>``, ``<|transcribe|>``, ``<|startoflm|>``, ``<|startofprev|>``,
``<|nocaptions|>`` (``<|nospeech|>`` in large-v3), ``<|notimestamps|>``, then 1501 timestamp tokens
``<|0.00|>`` ... ``<|30.00|>`` (20 ms apart) starting right after ``<|notimestamps|>`` (they are
often absent from ``tokenizer.json``, so their ids are derived from ``<|notimestamps|>``).
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Iterable, Sequence

from ...errors import ModelLoadError
from ...languages import ISO_OF_WHISPER_TOKEN, LANGUAGE_NAMES  # ISO code -> English name

__all__ = ["WhisperTokenizer", "LANGUAGE_NAMES"]

TIME_PRECISION = 0.02  # seconds per timestamp token step

_LANG_RE = re.compile(r"^<\|([a-z]{2,3}(?:-[A-Za-z]+)?|haw|yue)\|>$")


class WhisperTokenizer:
    """Text <-> token ids for one Whisper vocabulary.

    Attributes (token ids): ``eot``, ``sot``, ``translate``, ``transcribe``, ``sot_lm``,
    ``sot_prev``, ``no_speech``, ``no_timestamps``, ``timestamp_begin`` (``<|0.00|>``);
    ``language_tokens``: ``{code: id}`` in vocabulary order; ``multilingual``; ``n_vocab``
    (model vocabulary size, including timestamp tokens).

    Raises:
        ModelLoadError: the file is missing/unreadable or a required special token is absent.
    """

    def __init__(self, tokenizer_json: str | os.PathLike, *, n_vocab: int | None = None,
                 suppress_ids: Sequence[int] | None = None, suppress_ids_begin: Sequence[int] | None = None):
        from tokenizers import Tokenizer

        p = Path(tokenizer_json)
        if not p.is_file():
            raise ModelLoadError(f"whisper tokenizer: {p} not found", code="model_not_found")
        try:
            self._tok = Tokenizer.from_file(str(p))
        except Exception as e:  # noqa: BLE001 - the tokenizers error type is not public
            raise ModelLoadError(f"whisper tokenizer: cannot parse {p}: {e}") from e
        vocab = self._tok.get_vocab(with_added_tokens=True)

        def need(*names: str) -> int:
            for n in names:
                if n in vocab:
                    return vocab[n]
            raise ModelLoadError(f"whisper tokenizer {p}: special token {' / '.join(names)} missing")

        self.eot = need("<|endoftext|>")
        self.sot = need("<|startoftranscript|>")
        self.translate = need("<|translate|>")
        self.transcribe = need("<|transcribe|>")
        self.sot_lm = need("<|startoflm|>")
        self.sot_prev = need("<|startofprev|>")
        self.no_speech = need("<|nospeech|>", "<|nocaptions|>")
        self.no_timestamps = need("<|notimestamps|>")
        self.timestamp_begin = vocab.get("<|0.00|>", self.no_timestamps + 1)
        langs = sorted((i, m.group(1)) for t, i in vocab.items()
                       if self.sot < i < self.translate and (m := _LANG_RE.match(t)))
        # keyed by ISO 639-1 code: <|jw|> is Javanese, "jv" (the one code Whisper spells otherwise)
        self.language_tokens = {ISO_OF_WHISPER_TOKEN.get(code, code): i for i, code in langs}
        self.n_vocab = n_vocab or (self.timestamp_begin + 1501)
        # An English-only vocabulary has eot = 50256 and 51864 entries; multilingual ones 51865+.
        self.multilingual = self.n_vocab >= 51865
        self._suppress_ids = list(suppress_ids) if suppress_ids else None
        self._suppress_ids_begin = list(suppress_ids_begin) if suppress_ids_begin else None

    # ---- text ----------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Plain BPE ids of ``text`` (no special tokens added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the non-special tokens in ``ids`` (ids >= eot are dropped)."""
        return self._tok.decode([int(i) for i in ids if int(i) < self.eot], skip_special_tokens=False)

    def decode_token_bytes(self, ids: Sequence[int]) -> list[str]:
        """Per-token text pieces (may split multi-byte characters; for word grouping use
        :meth:`split_to_words`)."""
        return [self.decode([i]) for i in ids]

    # ---- prompts -------------------------------------------------------------------------
    def language_token(self, code: str) -> int:
        """Id of ``<|code|>``. Raises ValueError for a language this vocabulary lacks."""
        try:
            return self.language_tokens[code]
        except KeyError:
            raise ValueError(f"language {code!r} is not in this Whisper vocabulary") from None

    def sot_sequence(self, language: str | None, task: str = "transcribe") -> list[int]:
        """Decoder prompt: ``[sot]`` for English-only models, ``[sot, <|lang|>, <|task|>]`` otherwise."""
        if not self.multilingual:
            return [self.sot]
        lang = self.language_token(language or "en")
        return [self.sot, lang, self.translate if task == "translate" else self.transcribe]

    def prompt(self, language: str | None, task: str = "transcribe", *, without_timestamps: bool = False) -> list[int]:
        """The full decoder prompt: :meth:`sot_sequence`, plus ``<|notimestamps|>`` when decoding
        without timestamps (as the reference does: the model then writes text only)."""
        seq = self.sot_sequence(language, task)
        return seq + [self.no_timestamps] if without_timestamps else seq

    # ---- suppression -----------------------------------------------------------------------
    @functools.cached_property
    def non_speech_tokens(self) -> list[int]:
        """Tokens of symbols that are not speech (the reference's list of punctuation/music
        symbols that encode to one token, alone or after a space), plus ``" -"`` and ``" '"``."""
        symbols = list("\"#()*+/:;<=>@[\\]^_`{|}~「」『』")
        symbols += "<< >> <<< >>> -- --- -( -[ (' (\" (( )) ((( ))) [[ ]] {{ }} ♪♪ ♪♪♪".split()
        misc = set("♩♪♫♬♭♮♯")
        out = {self.encode(" -")[0], self.encode(" '")[0]}
        for s in symbols + sorted(misc):
            for ids in (self.encode(s), self.encode(" " + s)):
                if ids and (len(ids) == 1 or s in misc):
                    out.add(ids[0])
        return sorted(out)

    @functools.cached_property
    def suppress_tokens(self) -> list[int]:
        """Tokens never sampled: the checkpoint's ``suppress_ids`` (CT2/HF config) or our
        non-speech list, plus the task/control tokens (translate, transcribe, sot, sot_prev,
        sot_lm, no_speech)."""
        base = set(self._suppress_ids) if self._suppress_ids else set(self.non_speech_tokens)
        base |= {self.translate, self.transcribe, self.sot, self.sot_prev, self.sot_lm, self.no_speech}
        return sorted(t for t in base if 0 <= t < self.n_vocab)

    @functools.cached_property
    def suppress_tokens_begin(self) -> list[int]:
        """Tokens suppressed at the first sampled position: ``" "`` (blank) and eot."""
        if self._suppress_ids_begin:
            return sorted(set(self._suppress_ids_begin))
        return sorted(set(self.encode(" ")) | {self.eot})

    # ---- timestamps ------------------------------------------------------------------------
    def is_timestamp(self, tok: int) -> bool:
        return tok >= self.timestamp_begin

    def timestamp_seconds(self, tok: int) -> float:
        return (tok - self.timestamp_begin) * TIME_PRECISION

    def split_to_words(self, ids: Sequence[int]) -> tuple[list[str], list[list[int]]]:
        """Group text token ids into words (a new word starts at a token whose text begins with a
        space; punctuation stays attached to its word, as Whisper prints it). Returns (words, token-id lists per word); decoding is done on
        whole words so multi-byte characters are intact."""
        words: list[str] = []
        groups: list[list[int]] = []
        cur: list[int] = []
        for t in ids:
            if t >= self.eot:
                continue
            if cur and self.decode([t]).startswith(" "):
                groups.append(cur)
                cur = []
            cur.append(t)
        if cur:
            groups.append(cur)
        for g in groups:
            words.append(self.decode(g))
        return words, groups
