"""TDT (token-and-duration transducer) prediction network, joint network and greedy decoding.

Follows NVIDIA NeMo 3.0.0 (``RNNTDecoder``, ``RNNTJoint``, ``GreedyTDTInfer`` and
``GreedyBatchedTDTLabelLoopingComputer``) and the TDT paper (Xu et al. 2023,
arXiv 2304.06795); batched label looping after Bataev et al. 2024 (arXiv 2406.06220).

Vocabulary layout of the joint output (``V`` = number of SentencePiece pieces):
``[0, V)`` token logits, ``V`` blank, ``[V + 1, V + 1 + n_durations)`` duration logits.

Public interface (the GPU engine in ``flashasr.engine`` captures it in CUDA graphs):

* :class:`TDTPredictor` ``.step(tokens, state) -> (g, new_state)``, ``.init_state(...)``
* :class:`TDTJoint` ``.project_encoder``, ``.project_predictor``, ``.joint_after_projection``
* :func:`greedy_tdt_reference` (clear per-utterance loop) and
  :func:`greedy_tdt_label_looping` (batched, tensors only) return identical
  :class:`Hypothesis` lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from ...errors import UnsupportedModelError

State = tuple[torch.Tensor, torch.Tensor]

_ACTIVATIONS = {"relu": nn.ReLU, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh}


@dataclass
class Hypothesis:
    """One decoded utterance.

    ``token_ids``: SentencePiece ids (never the blank id); ``token_frames``: encoder frame at
    which each token was emitted (multiply by the frame duration, 0.08 s for Parakeet v2/v3,
    for seconds); ``token_durations``: the predicted TDT duration (in encoder frames) of each
    token, i.e. how far decoding advanced after emitting it.
    """

    token_ids: list[int] = field(default_factory=list)
    token_frames: list[int] = field(default_factory=list)
    token_durations: list[int] = field(default_factory=list)


class TDTPredictor(nn.Module):
    """Prediction network: embedding (blank row = zero vector = start symbol) + LSTM stack.

    NeMo ``RNNTDecoder`` with ``blank_as_pad: true``: ``Embedding(V + 1, H, padding_idx=V)``
    followed by ``nn.LSTM(H, H, num_layers=L)``; no output projection (``g`` is the LSTM output).

    Attributes:
        blank_id: the blank id ``V`` (also the start symbol).
        hidden: ``H`` = ``pred_hidden``; num_layers: ``L``.
    """

    def __init__(self, vocab_size: int, pred_hidden: int, num_layers: int):
        super().__init__()
        self.vocab_size = int(vocab_size)
        self.blank_id = int(vocab_size)
        self.hidden = int(pred_hidden)
        self.num_layers = int(num_layers)
        self.embed = nn.Embedding(self.vocab_size + 1, self.hidden, padding_idx=self.blank_id)
        self.lstm = nn.LSTM(self.hidden, self.hidden, num_layers=self.num_layers, batch_first=True)

    def init_state(self, batch: int, device=None, dtype=None) -> State:
        """Zero LSTM state ``(h, c)``, each ``[L, batch, H]``."""
        dtype = dtype or self.embed.weight.dtype
        device = device or self.embed.weight.device
        z = torch.zeros(self.num_layers, batch, self.hidden, device=device, dtype=dtype)
        return z, z.clone()

    def step(self, tokens: torch.Tensor, state: State | None) -> tuple[torch.Tensor, State]:
        """Advance the predictor by one label for every row.

        Args:
            tokens: LongTensor ``[B]``; ``blank_id`` means the start symbol (zero embedding).
            state: ``(h, c)`` each ``[L, B, H]``, or None for the zero state.
        Returns:
            ``g`` ``[B, H]`` (predictor output, dtype of the weights) and the new ``(h, c)``.
        """
        emb = self.embed(tokens)  # [B, H]; blank row is zero in NeMo checkpoints
        emb = emb * (tokens != self.blank_id).unsqueeze(-1).to(emb.dtype)  # guarantee SOS == 0
        if state is None:
            state = self.init_state(tokens.shape[0], emb.device, emb.dtype)
        out, (h, c) = self.lstm(emb.unsqueeze(1), state)
        return out[:, 0], (h, c)


class TDTJoint(nn.Module):
    """Joint network: ``out(act(enc(f) + pred(g)))`` with ``V + 1 + n_durations`` outputs.

    NeMo ``RNNTJoint`` (``joint.enc``, ``joint.pred``, ``joint.joint_net``); returns raw
    logits (NeMo applies a log-softmax over all outputs on CPU only; argmaxes are equal).

    Attributes: ``blank_id`` (= V), ``num_classes_with_blank`` (= V + 1), ``durations``
    (list of ints, encoder frames), ``num_durations``, ``max_symbols_per_step``.
    """

    def __init__(self, enc_hidden: int, pred_hidden: int, joint_hidden: int, num_classes: int,
                 durations: Sequence[int], activation: str = "relu", max_symbols_per_step: int | None = 10):
        super().__init__()
        act = str(activation).lower()
        if act not in _ACTIVATIONS:
            raise UnsupportedModelError(f"joint activation {activation!r} is not supported "
                                        f"(expected one of {sorted(_ACTIVATIONS)})")
        self.num_classes = int(num_classes)
        self.blank_id = self.num_classes
        self.num_classes_with_blank = self.num_classes + 1
        self.durations = [int(d) for d in durations]
        self.num_durations = len(self.durations)
        self.max_symbols_per_step = max_symbols_per_step
        self.enc = nn.Linear(enc_hidden, joint_hidden)
        self.pred = nn.Linear(pred_hidden, joint_hidden)
        self.act = _ACTIVATIONS[act]()
        self.out = nn.Linear(joint_hidden, self.num_classes + 1 + self.num_durations)

    def project_encoder(self, enc: torch.Tensor) -> torch.Tensor:
        """``[B, T, D_enc] -> [B, T, J]`` (``joint.enc``)."""
        return self.enc(enc)

    def project_predictor(self, g: torch.Tensor) -> torch.Tensor:
        """``[B, H_pred] -> [B, J]`` (``joint.pred``)."""
        return self.pred(g)

    def joint_after_projection(self, f: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """``f [B, J]`` + ``g [B, J]`` -> raw logits ``[B, V + 1 + n_durations]`` (no softmax)."""
        return self.out(self.act(f + g))

    def forward(self, enc: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Full joint: enc ``[B, T, D_enc]``, g ``[B, U, H]`` -> ``[B, T, U, V + 1 + n_d]``."""
        return self.out(self.act(self.project_encoder(enc)[:, :, None] + self.pred(g)[:, None]))


def _as_btd(encoder_output: torch.Tensor, channels_first: bool, joint: nn.Module) -> torch.Tensor:
    """``[B, T, D]`` view in the joint's dtype (a bf16 encoder output meets a float32 joint)."""
    if encoder_output.dim() != 3:
        raise ValueError(f"encoder_output must be 3-D, got shape {tuple(encoder_output.shape)}")
    x = encoder_output.transpose(1, 2) if channels_first else encoder_output
    p = next(joint.parameters(), None)
    return x.to(p.dtype) if p is not None and p.dtype != x.dtype else x


def greedy_tdt_reference(encoder_output: torch.Tensor, encoded_lengths: torch.Tensor,
                         predictor: TDTPredictor, joint: TDTJoint, durations: Sequence[int],
                         blank_id: int, max_symbols: int | None = 10, *,
                         channels_first: bool = False,
                         nemo_max_symbols_quirk: bool = False) -> list[Hypothesis]:
    """Greedy TDT decoding, one utterance at a time (the clear reference loop).

    Rules (NeMo ``GreedyTDTInfer``; fixture README "Decoding rules"): start from the predictor
    output for blank (zero embedding) with zero LSTM state; at frame ``t``: token = argmax over
    the ``V + 1`` token/blank logits, duration = ``durations[argmax(duration logits)]``. A
    non-blank token is emitted at frame ``t`` and the predictor advances with it; then
    ``t += duration`` (blank with duration 0 counts as 1). Decoding stays on frame ``t``
    while tokens come with duration 0; after ``max_symbols`` tokens on one frame with the last
    one of duration 0, ``t += 1``.

    ``nemo_max_symbols_quirk=True`` reproduces a NeMo ``GreedyTDTInfer`` detail: when the
    ``max_symbols``-th step on a frame has duration d > 0 it advances ``d + 1`` (the batched
    NeMo decoder, and our default, advance ``d``).

    Args:
        encoder_output: ``[B, T, D_enc]`` (``channels_first=False``, default) or NeMo's
            ``[B, D_enc, T]`` (``channels_first=True``); any float dtype (cast to the joint's).
        encoded_lengths: ``[B]`` valid encoder frames per item.
        predictor, joint: the model's :class:`TDTPredictor` / :class:`TDTJoint`.
        durations: TDT duration values in encoder frames (e.g. ``[0, 1, 2, 3, 4]``).
        blank_id: blank index ``V``; max_symbols: tokens per frame limit (None: no limit).
    Returns:
        one :class:`Hypothesis` per item.
    """
    enc = _as_btd(encoder_output, channels_first, joint)
    durs = [int(d) for d in durations]
    limit = max_symbols if max_symbols is not None else float("inf")
    out: list[Hypothesis] = []
    with torch.no_grad():
        f_all = joint.project_encoder(enc)
        for b in range(enc.shape[0]):
            hyp = Hypothesis()
            length = int(encoded_lengths[b])
            tok = torch.full((1,), blank_id, dtype=torch.long, device=enc.device)
            g, state = predictor.step(tok, None)
            gp = joint.project_predictor(g)
            t = 0
            while t < length:
                n = 0
                while True:
                    logits = joint.joint_after_projection(f_all[b:b + 1, t], gp)[0]
                    k = int(torch.argmax(logits[: blank_id + 1]))
                    d = durs[int(torch.argmax(logits[blank_id + 1:]))]
                    n += 1
                    if k != blank_id:
                        hyp.token_ids.append(k)
                        hyp.token_frames.append(t)
                        hyp.token_durations.append(d)
                        tok = torch.full((1,), k, dtype=torch.long, device=enc.device)
                        g, state = predictor.step(tok, state)
                        gp = joint.project_predictor(g)
                        step = d
                    else:
                        step = max(d, 1)
                    t += step
                    if step > 0 or n >= limit:
                        break
                if n >= limit and (step == 0 or nemo_max_symbols_quirk):
                    t += 1
            out.append(hyp)
    return out


def greedy_tdt_label_looping(encoder_output: torch.Tensor, encoded_lengths: torch.Tensor,
                             predictor: TDTPredictor, joint: TDTJoint, durations: Sequence[int],
                             blank_id: int, max_symbols: int | None = 10, *,
                             channels_first: bool = False) -> list[Hypothesis]:
    """Batched greedy TDT decoding by label looping (Bataev et al. 2024; NeMo ``greedy_batch``).

    All items advance together: each outer step finds, for every active item, the next
    non-blank label (an inner loop skips blanks frame by frame, masked with ``torch.where``),
    then runs the predictor once on the whole batch and keeps the new state only for rows
    that found a label. Everything stays in tensors on the encoder's device; the only host
    synchronisations are the two loop conditions (``any`` active / any still searching).
    Results (token ids, frames, durations) equal :func:`greedy_tdt_reference`.

    Args and returns: as :func:`greedy_tdt_reference`.
    """
    enc = _as_btd(encoder_output, channels_first, joint)
    with torch.no_grad():
        hyps, _ = label_looping_chunk(joint.project_encoder(enc), encoded_lengths, predictor, joint, durations,
                                      blank_id, max_symbols, carry=None)
    return hyps


@dataclass
class DecoderCarry:
    """The decoding state one chunk hands to the next (batched, on the decoder's device).

    ``time [B]`` long: frames to skip at the start of the next chunk (a TDT duration that jumped
    past the end of this one); ``gp [B, J]``: the joint's projection of the predictor output for
    the last label (the start symbol at first); ``state``: the predictor's ``(h, c)``, each
    ``[L, B, H]``. NeMo keeps the same in ``BatchedLabelLoopingState`` (``time_jumps``,
    predictor states and outputs) for chunked decoding.
    """

    time: torch.Tensor
    gp: torch.Tensor
    state: State

    @classmethod
    def start(cls, batch: int, predictor: TDTPredictor, joint: TDTJoint, blank_id: int,
              device=None) -> "DecoderCarry":
        """The state before the first frame: time 0, the start symbol (blank) from the zero state."""
        dev = device or joint.enc.weight.device
        with torch.no_grad():
            g, state = predictor.step(torch.full((batch,), blank_id, dtype=torch.long, device=dev), None)
            gp = joint.project_predictor(g)
        return cls(torch.zeros(batch, dtype=torch.long, device=dev), gp, state)


def label_looping_chunk(f_all: torch.Tensor, encoded_lengths: torch.Tensor, predictor: TDTPredictor,
                        joint: TDTJoint, durations: Sequence[int], blank_id: int, max_symbols: int | None = 10,
                        *, carry: DecoderCarry | None = None) -> tuple[list[Hypothesis], DecoderCarry]:
    """Label looping over one chunk of joint-projected encoder frames, from a carried state.

    Args:
        f_all: ``[B, T, J]`` ``joint.project_encoder`` of the chunk's encoder frames.
        encoded_lengths: ``[B]`` valid frames of each row in this chunk.
        carry: the state after the previous chunk (None: :meth:`DecoderCarry.start`).
    Returns:
        per row a :class:`Hypothesis` with frames relative to the chunk's first frame, and the
        carry for the next chunk. Decoding a sequence chunk by chunk gives exactly the tokens,
        frames (offset by each chunk's start) and durations of decoding it whole: the decisions
        at a frame depend only on that frame and the carried state, a duration that jumps past a
        chunk's end continues in the next one (``carry.time``), and the max-symbols count never
        spans chunks (a chunk is left only once decoding has moved past its last frame).
    """
    B, T, _ = f_all.shape
    dev = f_all.device
    limit = int(max_symbols) if max_symbols is not None else None
    if carry is None:
        carry = DecoderCarry.start(B, predictor, joint, blank_id, dev)
    with torch.no_grad():
        lengths = encoded_lengths.to(device=dev, dtype=torch.long).clamp(max=T)
        dur_values = torch.as_tensor([int(d) for d in durations], dtype=torch.long, device=dev)
        rows = torch.arange(B, device=dev)
        last_index = (lengths - 1).clamp(min=0)
        gp, state = carry.gp, carry.state
        time = carry.time.to(dev).clone()
        last_frame = torch.full((B,), -1, dtype=torch.long, device=dev)
        run = torch.zeros(B, dtype=torch.long, device=dev)
        rec_labels, rec_frames, rec_durs, rec_found = [], [], [], []

        def joint_at(tidx: torch.Tensor):
            logits = joint.joint_after_projection(f_all[rows, torch.minimum(tidx, last_index)], gp)
            lab = logits[:, : blank_id + 1].argmax(-1)
            dur = dur_values[logits[:, blank_id + 1:].argmax(-1)]
            return lab, dur

        active = time < lengths
        while bool(active.any()):
            label, dur = joint_at(time)
            is_blank = label == blank_id
            dur = torch.where(is_blank & (dur == 0), torch.ones_like(dur), dur)
            frame = time.clone()
            time = time + dur * active
            searching = active & is_blank & (time < lengths)
            while bool(searching.any()):
                lab2, dur2 = joint_at(time)
                blank2 = lab2 == blank_id
                dur2 = torch.where(blank2 & (dur2 == 0), torch.ones_like(dur2), dur2)
                label = torch.where(searching, lab2, label)
                dur = torch.where(searching, dur2, dur)
                frame = torch.where(searching, time, frame)
                time = time + dur2 * searching
                searching = searching & blank2 & (time < lengths)
            found = active & (label != blank_id)
            rec_labels.append(label)
            rec_frames.append(frame)
            rec_durs.append(dur)
            rec_found.append(found)
            # predictor update for rows that found a label; others keep state and output
            g_new, (h_new, c_new) = predictor.step(torch.where(found, label, blank_id), state)
            keep = found.unsqueeze(-1)
            gp = torch.where(keep, joint.project_predictor(g_new), gp)
            state = (torch.where(keep.unsqueeze(0), h_new, state[0]),
                     torch.where(keep.unsqueeze(0), c_new, state[1]))
            if limit is not None:
                run = torch.where(found, torch.where(frame == last_frame, run + 1, 1), run)
                last_frame = torch.where(found, frame, last_frame)
                force = found & (dur == 0) & (run >= limit)
                time = time + force.long()
            active = time < lengths
        out_carry = DecoderCarry(time - lengths, gp, state)
        if not rec_labels:
            return [Hypothesis() for _ in range(B)], out_carry
        labels = torch.stack(rec_labels, 1).cpu()
        frames = torch.stack(rec_frames, 1).cpu()
        durs = torch.stack(rec_durs, 1).cpu()
        found = torch.stack(rec_found, 1).cpu()
    out = []
    for b in range(B):
        m = found[b]
        out.append(Hypothesis(labels[b][m].tolist(), frames[b][m].tolist(), durs[b][m].tolist()))
    return out, out_carry


__all__ = ["Hypothesis", "TDTPredictor", "TDTJoint", "greedy_tdt_reference", "greedy_tdt_label_looping",
           "DecoderCarry", "label_looping_chunk"]
