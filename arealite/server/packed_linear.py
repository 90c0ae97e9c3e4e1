"""Linear layers of the server's model on oneDNN's pre-packed weights (CPU).

``torch.nn.functional.linear`` on CPU calls MKL's GEMM on the plain ``[out, in]`` weight every
step. For the server's decode shapes (a few dozen rows against a 576 x 1536 or 576 x 49152
weight) that runs at a fraction of the machine's GEMM rate. oneDNN can reorder a weight once
into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``) and multiply against it
directly (``torch.ops.mkldnn._linear_pointwise``); the same as vLLM's CPU backend does with its
oneDNN handles, and inductor's CPU "freezing" pass. Measured on a 2-core AVX2 EPYC, 2 threads,
fp32 (``benchmarks/server_profile.py``): [32, 576] x [576, 1536] 66 -> 97 GFLOP/s and the LM head
[32, 576] x [576, 49152] 32 -> 76 GFLOP/s.

The HF model code is unchanged: each ``nn.Linear`` keeps its ``weight`` parameter (weight loads
by name, LoRA merges and direct calls of the model work as before) and gets a packed copy that
its forward uses inside ``torch.inference_mode`` / ``no_grad``. The copy doubles the memory of
the linear weights. It is rebuilt on first use whenever the weight's storage or version counter
changed since it was packed (every weight loader of the server writes in place, bumping the
counter), or after :func:`invalidate`.

oneDNN builds (JIT-compiles) one primitive per input row count and keeps it in two caches of 1024
entries each (oneDNN's and ideep's), about 0.6-1 MiB apiece. A server sees every row count from 1
to ``max_prefill_tokens``, so its memory grew by hundreds of MiB over a run (measured: +730 MiB
over 22 load rounds of ``benchmarks/server_load.py`` with the tiny test model, against +140 MiB
with plain ``F.linear``). The packed forward therefore pads the rows up to :func:`row_bucket`: at
most 8 sizes per power of two (at most 12.5 % padded rows), 64 row counts up to 1024.
"""

from __future__ import annotations

import types

import torch

PACK_BATCH_HINT = 32  # oneDNN picks the blocked layout for about this many rows (any count works)
EXACT_ROWS = 16  # row counts up to this run unpadded


def row_bucket(m: int) -> int:
    """The row count the packed GEMM runs ``m`` rows as: ``m`` itself up to ``EXACT_ROWS``, else
    ``m`` rounded up to a multiple of 1/8 of the power of two below it (17 -> 18, 33 -> 36,
    100 -> 104, 1000 -> 1024), so at most 8 distinct counts per octave and at most 12.5 % padding.
    """
    if m <= EXACT_ROWS:
        return m
    step = 1 << (m.bit_length() - 4)
    return -(-m // step) * step


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """True when oneDNN's packed linear can run here: CPU, fp32 (or bf16 where oneDNN supports
    it: not on an AVX2-only CPU), a torch built with oneDNN that has the packed-linear ops."""
    ok = (torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16)
          and torch.backends.mkldnn.is_available()
          and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
          and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    if ok and dtype == torch.bfloat16:  # oneDNN's bf16 reorder needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT
        ok = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return ok


def _stamp(weight: torch.Tensor) -> tuple[int, int]:
    return weight.data_ptr(), weight._version


def _pack(module: torch.nn.Linear) -> None:
    with torch.no_grad():
        w = module.weight.detach()
        module._arealite_packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
        module._arealite_stamp = _stamp(module.weight)


def _needs_plain(module: torch.nn.Linear, x: torch.Tensor) -> bool:
    """Autograd needs the weight's gradient, or ``x`` is not a plain CPU tensor of its dtype."""
    w = module.weight
    return ((torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)) or x.dtype != w.dtype
            or x.layout != torch.strided or x.device.type != "cpu")


def _linear_rows(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` ``[..., in]`` times a packed weight -> ``[..., out]``, the rows padded with zeros
    to :func:`row_bucket` (one oneDNN primitive per bucket, not per row count: module
    docstring) and sliced off again."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    padded = row_bucket(m)
    if padded != m:
        rows = torch.cat([rows, rows.new_zeros(padded - m, k)])
    y = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return y[:m].reshape(*lead, y.shape[-1])


def _packed_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` on the packed weight; ``x`` ``[..., in]`` -> ``[..., out]``.
    Falls back to ``F.linear`` when autograd needs the weight's gradient or ``x`` is not a
    plain tensor of the weight's dtype."""
    if _needs_plain(module, x):
        return torch.nn.functional.linear(x, module.weight, module.bias)
    if module._arealite_stamp != _stamp(module.weight):
        _pack(module)
    return _linear_rows(x, module._arealite_packed, module.bias)


FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # siblings fed the same input


class _FusedGroup:
    """Sibling linears that the model calls one after another on the same input (a decoder
    layer's q/k/v projections, its MLP's gate/up): one packed GEMM against their concatenated
    weights computes all their outputs at the first member's call, the other members get their
    column slice of it. Fewer, larger GEMMs: 4 instead of 7 per Llama layer (SmolLM2-135M bf16,
    2 threads: decode step 60 -> 56 ms at 32 rows, 28 -> 26 ms at 8)."""

    def __init__(self, members: list[torch.nn.Linear]):
        self.members = members
        self.sizes = [m.out_features for m in members]
        self.stamps = None
        self.packed = self.bias = None
        self.input = self.outputs = None
        self.pending: set[int] = set()

    def pack(self) -> None:
        with torch.no_grad():
            w = torch.cat([m.weight.detach() for m in self.members])
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
            bias = [m.bias for m in self.members]
            self.bias = None if bias[0] is None else torch.cat([b.detach() for b in bias])
        self.stamps = [_stamp(m.weight) for m in self.members]

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``index``'s output for ``x``: computed for all members unless ``x`` is the
        very tensor of the last computation (held here, so its id is not reused; outside
        inference mode also unmodified since), that computation's output for ``index`` was not
        taken yet and no member's weight changed since. Once every member took its output the
        input and outputs are released."""
        version = 0 if x.is_inference() else x._version  # inference tensors have no counter
        if self.stamps != [_stamp(m.weight) for m in self.members]:
            self.pack()
            self.input = None
        if self.input is None or self.input[0] is not x or self.input[1] != version or index not in self.pending:
            self.outputs = _linear_rows(x, self.packed, self.bias).split(self.sizes, dim=-1)
            self.input, self.pending = (x, version), set(range(len(self.members)))
        out = self.outputs[index]
        self.pending.discard(index)
        if not self.pending:  # every member has its output: hold no activations until the next call
            self.input = self.outputs = None
        return out

    def forget(self) -> None:
        """Drop the held input/outputs and mark the packed weight stale."""
        self.input = self.outputs = None
        self.pending = set()
        self.stamps = None


def _fused_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if _needs_plain(module, x):
        return torch.nn.functional.linear(x, module.weight, module.bias)
    return module._arealite_group.output(module._arealite_group_index, x)


def _fusable(members) -> bool:
    first = members[0]
    return all(type(m) is torch.nn.Linear and m.in_features == first.in_features
               and m.weight.dtype == first.weight.dtype and (m.bias is None) == (first.bias is None)
               for m in members)


def _fp32_head_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The bf16 LM head with float32 logits: ``x`` ``[..., H]`` -> ``[..., V]`` float32 from
    :func:`arealite.native.linear_bf16_f32` on the weight packed once per weight version; the
    module's bf16 forward when the kernel cannot take ``x``."""
    from arealite import native

    if not _needs_plain(module, x) and x.shape[-1] % 2 == 0:
        if module._arealite_vnni_stamp != _stamp(module.weight):
            module._arealite_vnni = native.pack_bf16(module.weight.detach())
            module._arealite_vnni_stamp = _stamp(module.weight)
        if module._arealite_vnni is not None:
            rows = x.reshape(-1, x.shape[-1])
            y = native.linear_bf16_f32(rows if rows.stride(-1) == 1 else rows.contiguous(), module.weight,
                                       module._arealite_vnni)
            if y is not None:
                if module.bias is not None:
                    y += module.bias.float()
                return y.reshape(*x.shape[:-1], y.shape[-1])
    return module._arealite_bf16_forward(x)


def fp32_lm_head(model: torch.nn.Module) -> bool:
    """Make a bf16 model's LM head return float32 logits computed from the bf16 hidden states and
    weight with fp32 sums (:func:`arealite.native.linear_bf16_f32`, the weight packed once per
    weight version), as the trainer's head does (:mod:`arealite.train_engine.lm_head`). A bf16
    head rounds the logits to bf16 (steps of 0.125 at |logit| 16-32), and that rounding was most
    of the bf16 server's logprob mismatch with the bf16 trainer: mismatch KL k3 6.3e-4 -> 1.3e-4,
    mean |Δ log p| 2.4e-2 -> 3.1e-3 on SmolLM2-135M (``python benchmarks/precision.py``), at the
    same speed as oneDNN's packed bf16 head. MiniMax-M1 (arXiv:2506.13585, section 3.3) found
    the same and keeps its LM head in fp32.

    Call before :func:`pack_linears` (the head then gets no oneDNN copy). Returns True when the
    head now gives fp32 logits; False (nothing changed) for a model that is not bf16 on the CPU
    or where the kernel cannot run (no compiler, a CPU without AVX-512 BF16).
    """
    from arealite import native

    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.weight.dtype != torch.bfloat16 or head.weight.device.type != "cpu":
        return False
    if native.pack_bf16(head.weight.detach()[:32]) is None:  # the kernel runs here
        return False
    head._arealite_bf16_forward = head.forward
    head._arealite_vnni, head._arealite_vnni_stamp = None, None
    head.forward = types.MethodType(_fp32_head_forward, head)
    return True


def pack_linears(model: torch.nn.Module) -> int:
    """Give every ``nn.Linear`` of ``model`` a packed weight and the packed forward (siblings
    named in :data:`FUSED_GROUPS` one packed weight per group, :class:`_FusedGroup`); returns how
    many linears now run packed. Call only where :func:`available` is True."""
    fused = set()
    for parent in model.modules():
        for names in FUSED_GROUPS:
            members = [getattr(parent, n, None) for n in names]
            if all(isinstance(m, torch.nn.Module) for m in members) and _fusable(members):
                group = _FusedGroup(members)
                group.pack()
                for i, m in enumerate(members):
                    m._arealite_group, m._arealite_group_index = group, i
                    m.forward = types.MethodType(_fused_forward, m)
                    fused.add(m)
    n = len(fused)
    for module in model.modules():
        if (type(module) is torch.nn.Linear and module not in fused  # not PEFT/quantised subclasses
                and not hasattr(module, "_arealite_vnni")):  # nor an fp32 LM head (fp32_lm_head)
            _pack(module)
            module.forward = types.MethodType(_packed_forward, module)
            n += 1
    return n


def invalidate(model: torch.nn.Module) -> None:
    """Mark every packed copy stale after the weights changed in a way their version counters
    do not show (a write through ``.data``): each layer repacks on its next forward (~0.5 s for
    all of SmolLM2-135M's on one thread). The server's own loaders bump the counters, so the
    scheduler does not call this."""
    for module in model.modules():
        if hasattr(module, "_arealite_packed"):
            module._arealite_stamp = None
        if hasattr(module, "_arealite_group"):
            module._arealite_group.forget()
        if hasattr(module, "_arealite_vnni"):
            module._arealite_vnni_stamp = None
