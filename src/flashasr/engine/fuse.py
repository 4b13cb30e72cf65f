"""Inference fusions for the FastConformer encoder (engine side; the model code is untouched).

:func:`fuse_encoder` rewrites an eval-mode :class:`~flashasr.models.parakeet.encoder.ConformerEncoder`
in place with transforms whose maths equals the unfused encoder (results differ only by float
rounding, and not at all where noted):

``bn_fold``
    Conformer conv module: eval-mode BatchNorm (``y = (x - mean) / sqrt(var + eps) * g + b``)
    folded into the preceding depthwise Conv1d: ``w' = w * s``, ``b' = (b_conv - mean) * s + b``
    with ``s = g / sqrt(var + eps)`` (computed in float64, stored in the conv's dtype). Removes the
    normalisation pass (and, with bf16 encoders, its float32 up/down casts). ``state_dict()``
    still gives the unfolded weights (the model's checkpoint format; ``keep_vars=True`` gives
    the live, folded parameters) and ``load_state_dict`` re-folds from what it loads.
``conv_pad``
    Depthwise conv with symmetric padding ``(k-1)/2`` (NeMo's non-causal case): the explicit
    ``F.pad`` copy is replaced by the conv's own zero padding (bit-identical).
``inplace``
    Conv module: GLU output masked in place, SiLU in place (fewer allocations; bit-identical).
``sub_masks``
    dw_striding subsampling: the time mask before each 1x1 (stride-1) pointwise conv is skipped.
    Exact: a 1x1 conv and the ReLU after it act on each time step alone, and the next mask
    (before the next 3x3 conv, or the final one) zeroes the same steps again, so valid steps are
    bit-identical. ReLU runs in place.

``conv_nhwc`` (default since it was measured on the H200: +11.6 % end to end, 9,282x ->
    10,355x, ``bench/results/gpu_e2e_conv_nhwc.json``)
    Conv module in the encoder's own ``[B, T, d]`` layout: the two pointwise convs as matmuls
    (``F.linear`` with the squeezed 1x1 weights), GLU on the last dimension, and the depthwise
    conv as a 2-D depthwise conv on a channels-last view (``[B, T, d]`` seen as NCHW
    ``[B, d, 1, T]`` without a copy), so the module does no transpose copies and cuDNN can run
    its NHWC depthwise kernel instead of PyTorch's native channels-first one (4.8 % of the
    encoder in the H200 profile). Same maths; float rounding may differ.

``add_norm``
    Conformer block: each residual step ``r = r + alpha * branch(LN(r))`` and the LayerNorm
    after it run as one kernel (:func:`flashasr.engine.triton_norm.add_layer_norm`: Triton on
    CUDA, else the unfused PyTorch maths, bit-identical). Per block 5 LayerNorms, 4 adds and 2
    scales (and, for bf16 encoders, 10 float32 casts) become 5 kernels.

Not done (not exact or not measured): skipping masks for unpadded batches (lengths are data
inside CUDA graphs), fusing the first mask into the log-mel, bf16 joint projection.

Apply before :func:`~flashasr.engine.profiles.prepare_encoder_precision` (the fold is then
computed from float32 weights). :class:`~flashasr.engine.profiles.EncoderProfiles` and
:class:`~flashasr.engine.offline.OfflineParakeetEngine` apply it unless ``fuse=False``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..models.parakeet.encoder import ConformerConvolution, ConformerEncoder, ConformerLayer, DwStridingSubsampling
from .triton_norm import add_layer_norm, layer_norm

ALL_TRANSFORMS = ("bn_fold", "conv_pad", "inplace", "sub_masks", "conv_nhwc", "add_norm")  # the default set
EXTRA_TRANSFORMS: tuple = ()  # opt-in candidates (fuse=ALL_TRANSFORMS + EXTRA_TRANSFORMS); none now


class FusedConformerConvolution(ConformerConvolution):
    """:class:`ConformerConvolution` after :func:`fuse_encoder` (set as the instance's class).

    Attributes set by the fuse: ``_fold`` (BatchNorm folded into ``depthwise_conv``; the
    ``batch_norm`` module is kept but unused), ``_own_pad`` (depthwise conv pads itself),
    ``_inplace``.
    """

    _fold = False
    _own_pad = False
    _inplace = False
    _nhwc = False

    def _forward_nhwc(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        pw1, dw, pw2 = self.pointwise_conv1, self.depthwise_conv, self.pointwise_conv2
        x = F.glu(F.linear(x, pw1.weight.squeeze(-1), pw1.bias), dim=-1)  # [B, T, d]
        x = torch.where(valid[:, :, None], x, 0.0)  # == masked_fill(~valid, 0): one kernel, not two
        k = dw.weight.shape[-1]
        x4 = x.view(B, 1, T, d).permute(0, 3, 1, 2)  # NCHW [B, d, 1, T], channels-last memory, no copy
        pad = dw.padding[0] if self._own_pad else 0
        if not self._own_pad:
            l, r = self.padding
            x4 = F.pad(x4, (l, r))
        y = F.conv2d(x4, dw.weight.view(d, 1, 1, k), dw.bias, padding=(0, pad), groups=d)
        y = y.permute(0, 2, 3, 1).reshape(B, T, d)  # a view when cuDNN kept channels-last
        if not self._fold:
            if self.norm_type == "layer_norm":
                y = self.batch_norm(y)
            else:
                y = self.batch_norm(y.transpose(1, 2)).transpose(1, 2)
        return F.linear(F.silu(y, inplace=self._inplace), pw2.weight.squeeze(-1), pw2.bias)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """``x [B, T, d]``, ``valid [B, T]`` bool -> ``[B, T, d]`` (same as the unfused module)."""
        if self._nhwc:
            return self._forward_nhwc(x, valid)
        x = self.pointwise_conv1(x.transpose(1, 2))
        x = F.glu(x, dim=1)
        if self._inplace:
            x.masked_fill_(~valid[:, None, :], 0.0)
        else:
            x = x.masked_fill(~valid[:, None, :], 0.0)
        x = self.depthwise_conv(x if self._own_pad else F.pad(x, self.padding))
        if not self._fold:
            if self.norm_type == "layer_norm":
                x = self.batch_norm(x.transpose(1, 2)).transpose(1, 2)
            else:
                x = self.batch_norm(x)
        x = self.pointwise_conv2(F.silu(x, inplace=self._inplace))
        return x.transpose(1, 2)


class FusedConformerLayer(ConformerLayer):
    """:class:`ConformerLayer` whose residual adds are fused with the LayerNorm that follows
    (``_add_norm``; see ``add_norm`` in the module docstring). Same maths as the unfused block."""

    _add_norm = False

    def forward(self, x, valid, pos_emb, context=(-1, -1), impl="sdpa"):
        """``x [B, T, d]``, ``valid [B, T]`` bool, ``pos_emb [2T-1, d]`` (or the local-context
        positions) -> ``[B, T, d]`` in ``x``'s dtype, as the unfused block."""
        if not self._add_norm:
            return super().forward(x, valid, pos_emb, context, impl)
        h = layer_norm(x, self.norm_feed_forward1)
        r, h = add_layer_norm(x, self.feed_forward1(h), 0.5, self.norm_self_att)
        r, h = add_layer_norm(r, self.self_attn(h, valid, pos_emb, context, impl), 1.0, self.norm_conv)
        r, h = add_layer_norm(r, self.conv(h, valid), 1.0, self.norm_feed_forward2)
        return add_layer_norm(r, self.feed_forward2(h), 0.5, self.norm_out)[1]


class FusedDwStridingSubsampling(DwStridingSubsampling):
    """:class:`DwStridingSubsampling` without the masks before 1x1 stride-1 convs (``_skip_pw``)
    and with in-place ReLU; see the module docstring for why valid steps are unchanged."""

    _skip_pw = False

    def _forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.unsqueeze(1)
        L = lengths.long()
        for layer in self.conv:
            if isinstance(layer, nn.Conv2d):
                pointwise = layer.kernel_size == (1, 1) and layer.stride == (1, 1) and layer.padding == (0, 0)
                if not (self._skip_pw and pointwise):
                    keep = torch.arange(x.shape[2], device=x.device)[None, :] < L[:, None]
                    x = x * keep[:, None, :, None].to(x.dtype)
                x = layer(x)
                if layer.stride[0] != 1:
                    L = torch.div(L + 2 * layer.padding[0] - layer.kernel_size[0], layer.stride[0],
                                  rounding_mode="floor") + 1
            elif isinstance(layer, nn.ReLU):
                x = torch.relu_(x)
            else:
                x = layer(x)
        keep = torch.arange(x.shape[2], device=x.device)[None, :] < L[:, None]
        x = x * keep[:, None, :, None].to(x.dtype)
        b, c, t, f = x.shape
        x = self.out(x.transpose(1, 2).reshape(b, t, c * f))
        return x, L


@torch.no_grad()
def _fold_bn(conv: nn.Conv1d, bn: nn.BatchNorm1d) -> None:
    w = conv.weight.detach().double()
    s = bn.weight.detach().double() / torch.sqrt(bn.running_var.detach().double() + bn.eps)
    b0 = conv.bias.detach().double() if conv.bias is not None else torch.zeros_like(s)
    nb = (b0 - bn.running_mean.detach().double()) * s + bn.bias.detach().double()
    dt = conv.weight.dtype
    conv.weight.copy_((w * s[:, None, None]).to(dt))
    if conv.bias is None:
        conv.bias = nn.Parameter(nb.to(dt), requires_grad=False)
    else:
        conv.bias.copy_(nb.to(dt))


def _save_unfolded(mod: "FusedConformerConvolution") -> None:
    """Keep the depthwise conv's own (unfolded) weight and bias, and hook ``state_dict`` /
    ``load_state_dict`` so checkpoints keep the model's format: saving gives the unfolded
    weights (and no bias the model did not have); loading re-folds from the loaded values."""
    dw = mod.depthwise_conv
    mod.register_buffer("_dw_weight_unfolded", dw.weight.detach().clone(), persistent=False)
    mod.register_buffer("_dw_bias_unfolded", dw.bias.detach().clone() if dw.bias is not None else None,
                        persistent=False)
    mod._dw_had_bias = dw.bias is not None
    mod._register_state_dict_hook(_state_dict_unfolded)
    mod._register_load_state_dict_pre_hook(_load_pre_hook, with_module=True)
    mod.register_load_state_dict_post_hook(_load_post_hook)


def _state_dict_unfolded(mod, destination, prefix, local_metadata):
    # keep_vars=True (the live Parameters: tracers, ONNX export, optimisers) gets the real,
    # folded tensors; only a checkpoint (keep_vars=False, plain tensors) gets the model's format
    if not mod._fold or isinstance(destination.get(prefix + "depthwise_conv.weight"), nn.Parameter):
        return
    destination[prefix + "depthwise_conv.weight"] = mod._dw_weight_unfolded.detach().clone()
    if mod._dw_had_bias:
        destination[prefix + "depthwise_conv.bias"] = mod._dw_bias_unfolded.detach().clone()
    else:
        destination.pop(prefix + "depthwise_conv.bias", None)


def _load_pre_hook(mod, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    if not mod._fold:
        return
    wk, bk = prefix + "depthwise_conv.weight", prefix + "depthwise_conv.bias"
    mod._loading = (wk in state_dict, bk in state_dict)
    if not mod._dw_had_bias and bk not in state_dict:  # the fold's bias is ours, not the model's
        state_dict[bk] = torch.zeros_like(mod.depthwise_conv.bias)


@torch.no_grad()
def _load_post_hook(mod, incompatible_keys):
    loading = mod.__dict__.pop("_loading", None)
    if not mod._fold or loading is None:
        return
    dw = mod.depthwise_conv
    w = dw.weight.detach().clone() if loading[0] else mod._dw_weight_unfolded
    b = dw.bias.detach().clone() if (loading[1] and mod._dw_had_bias) else mod._dw_bias_unfolded
    mod._dw_weight_unfolded.copy_(w)
    if b is not None:
        mod._dw_bias_unfolded.copy_(b)
    dw.weight.copy_(mod._dw_weight_unfolded)
    dw.bias.copy_(mod._dw_bias_unfolded if mod._dw_bias_unfolded is not None else torch.zeros_like(dw.bias))
    bn = mod.batch_norm
    if isinstance(bn, nn.BatchNorm1d):  # the engine's float32-norm subclass is one too
        _fold_bn(dw, bn)


def fuse_encoder(encoder: ConformerEncoder, transforms=ALL_TRANSFORMS) -> dict:
    """Apply the inference fusions ``transforms`` (subset of :data:`ALL_TRANSFORMS`) in place.

    The encoder must be in eval mode (BatchNorm running statistics are folded). Idempotent:
    already applied transforms are skipped. Returns counts per transform (modules changed).

    Raises:
        TypeError: ``encoder`` is not a ConformerEncoder.
        ValueError: unknown transform name, or the encoder is in training mode.
    """
    if not isinstance(encoder, ConformerEncoder):
        raise TypeError(f"fuse_encoder expects a ConformerEncoder, got {type(encoder).__name__}")
    if isinstance(transforms, str):
        transforms = (transforms,)
    bad = set(transforms) - set(ALL_TRANSFORMS) - set(EXTRA_TRANSFORMS)
    if bad:
        raise ValueError(f"unknown fusion transforms {sorted(bad)} (known: {ALL_TRANSFORMS + EXTRA_TRANSFORMS})")
    if encoder.training:
        raise ValueError("fuse_encoder needs an eval-mode encoder (BatchNorm statistics are folded)")
    counts = {t: 0 for t in transforms}
    for mod in encoder.modules():
        if isinstance(mod, ConformerConvolution):
            if type(mod) is ConformerConvolution:
                mod.__class__ = FusedConformerConvolution
            if "bn_fold" in transforms and not mod._fold and mod.norm_type == "batch_norm" \
                    and isinstance(mod.batch_norm, nn.BatchNorm1d) and mod.batch_norm.track_running_stats:
                _save_unfolded(mod)
                _fold_bn(mod.depthwise_conv, mod.batch_norm)
                mod._fold = True
                counts["bn_fold"] += 1
            dw = mod.depthwise_conv
            l, r = mod.padding
            if "conv_pad" in transforms and not mod._own_pad and l == r and dw.padding == (0,) \
                    and dw.padding_mode == "zeros":
                dw.padding = (l,)
                mod._own_pad = True
                counts["conv_pad"] += 1
            if "inplace" in transforms and not mod._inplace:
                mod._inplace = True
                counts["inplace"] += 1
            if "conv_nhwc" in transforms and not mod._nhwc:
                mod._nhwc = True
                counts["conv_nhwc"] += 1
        elif isinstance(mod, ConformerLayer) and "add_norm" in transforms:
            if type(mod) is ConformerLayer:
                mod.__class__ = FusedConformerLayer
            if isinstance(mod, FusedConformerLayer) and not mod._add_norm:
                mod._add_norm = True
                counts["add_norm"] += 1
        elif isinstance(mod, DwStridingSubsampling) and "sub_masks" in transforms:
            if type(mod) is DwStridingSubsampling:
                mod.__class__ = FusedDwStridingSubsampling
            if not mod._skip_pw:
                mod._skip_pw = True
                counts["sub_masks"] += 1
    return counts


__all__ = ["fuse_encoder", "ALL_TRANSFORMS", "EXTRA_TRANSFORMS", "FusedConformerConvolution", "FusedConformerLayer",
           "FusedDwStridingSubsampling"]
