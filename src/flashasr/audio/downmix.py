"""Energy-keeping multichannel -> mono downmix.

The plain downmix (the mean of the channels, what ``ffmpeg -ac 1`` does for stereo and what
Whisper's ``load_audio`` therefore feeds the model) cancels a phase-inverted channel to
silence: for ``R = -L`` the mean is exactly zero and an ASR model hears nothing.

Rule used here (streaming, per decoded block, with state):

* Keep running energies (exponential moving average, time constant ``tau_s`` = 0.2 s of
  input) of every channel ``E_c`` and of the channel mean ``E_m``.
* Cancellation ratio ``r = C**2 * E_m / sum_c(E_c)``. ``r = 1`` for independent channels
  (e.g. a different speaker on each channel), ``r = C`` for identical channels, ``r -> 0``
  when channels cancel (phase inversion).
* Output the mean while ``r >= enter`` (0.25: at least 6 dB more cancellation than
  independent channels would show). Below it, switch to the *strongest channel* (largest
  running energy; a switch to another channel needs 2x its energy, so the choice does not
  flutter) until ``r > leave`` (0.5). Decisions are frozen while the input is near-silent
  (mean channel energy below ``floor`` = -100 dBFS), so silence never flips the mode.

So ordinary mono-compatible material (and independent channels such as a two-speaker
stereo file) is downmixed exactly like ``ffmpeg -ac 1`` for stereo (mean), and only
cancelling material falls back. A mode switch happens on a block edge (a decoded frame,
typically 20-100 ms); there is no crossfade, a step at a block edge is harmless to ASR
features. With the 0.2 s averaging, a phase inversion that starts mid-file costs at most a
few blocks of attenuated audio before the fallback engages.
"""

from __future__ import annotations

import math

import numpy as np


class Downmixer:
    """Stateful energy-keeping downmix of float32 blocks of shape [C, n] to [n].

    One instance per stream (not thread-safe). ``fallback_samples`` counts input samples
    emitted in strongest-channel mode (for a warning in :class:`DecodedAudio`); ``min_ratio`` is
    the smallest cancellation ratio ``r`` seen (inf before any non-silent multichannel block; the
    parallel decoder trusts a range's mean-only downmix when it stays >= ``leave``).
    """

    def __init__(self, *, tau_s: float = 0.2, enter: float = 0.25, leave: float = 0.5,
                 floor: float = 1e-10, switch_margin: float = 2.0):
        self.tau_s = tau_s
        self.enter = enter
        self.leave = leave
        self.floor = floor
        self.switch_margin = switch_margin
        self.mode = "mean"
        self.channel = 0
        self._e_ch: np.ndarray | None = None
        self._e_mean = 0.0
        self.fallback_samples = 0
        self.total_samples = 0
        self.min_ratio = math.inf

    def reset(self) -> None:
        self.mode = "mean"
        self._e_ch = None
        self._e_mean = 0.0

    def __call__(self, x: np.ndarray, rate: int) -> np.ndarray:
        """Downmix one block.

        Args:
            x: float32 [C, n] (or [n] for mono, returned unchanged).
            rate: sample rate of ``x`` in Hz (sets the averaging time constant).
        Returns:
            float32 [n]. A new array unless the input is already mono.
        """
        if x.ndim == 1:
            self.total_samples += x.shape[0]
            return x
        c, n = x.shape
        self.total_samples += n
        if c == 1:
            return x[0]
        if n == 0:
            return np.zeros(0, np.float32)
        if c == 2:
            mean = x[0] + x[1]
            mean *= np.float32(0.5)
        else:
            mean = np.add.reduce(x, axis=0)
            mean *= np.float32(1.0 / c)
        # BLAS dot products: one pass per channel, no temporaries
        e_ch = np.array([float(np.dot(x[i], x[i])) for i in range(c)]) / n
        e_m = float(np.dot(mean, mean)) / n
        if self._e_ch is None or self._e_ch.shape[0] != c:
            self._e_ch = e_ch
            self._e_mean = e_m
        else:
            a = 1.0 - math.exp(-n / (self.tau_s * rate))
            self._e_ch = self._e_ch + a * (e_ch - self._e_ch)
            self._e_mean += a * (e_m - self._e_mean)
        tot = float(self._e_ch.sum())
        if tot / c > self.floor:
            r = c * c * self._e_mean / tot
            self.min_ratio = min(self.min_ratio, r)
            if self.mode == "mean" and r < self.enter:
                self.mode = "strongest"
                self.channel = int(np.argmax(self._e_ch))
            elif self.mode == "strongest" and r > self.leave:
                self.mode = "mean"
            if self.mode == "strongest":
                best = int(np.argmax(self._e_ch))
                if best != self.channel and self._e_ch[best] > self.switch_margin * self._e_ch[self.channel]:
                    self.channel = best
        if self.mode == "mean":
            return mean
        self.fallback_samples += n
        return np.ascontiguousarray(x[self.channel])


def downmix_array(x: np.ndarray, rate: int, *, block: int | None = None) -> tuple[np.ndarray, Downmixer]:
    """Downmix a whole float32 [C, N] array in blocks of ``block`` samples (default 50 ms)
    with :class:`Downmixer`; returns (mono float32 [N], the downmixer for its counters)."""
    dm = Downmixer()
    if x.ndim == 1 or x.shape[0] == 1:
        return dm(x.reshape(-1) if x.ndim == 1 else x[0], rate), dm
    n = x.shape[1]
    block = block or max(1, rate // 20)
    out = np.empty(n, np.float32)
    for s in range(0, n, block):
        out[s:s + block] = dm(x[:, s:s + block], rate)
    return out, dm


__all__ = ["Downmixer", "downmix_array"]
