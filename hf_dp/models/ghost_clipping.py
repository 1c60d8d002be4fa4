"""Ghost clipping in one backward pass ("book-keeping"): per-example clipped gradient sums without
materialising per-example gradients.

Opacus' hooks materialise every example's gradient (``[B, *p.shape]`` per parameter) and Opacus'
own ghost mode needs a *second* backward pass with the clip factors as loss weights. Here one
backward pass captures, for every trainable layer, its input activations ``a`` and output gradients
``g``; then

* per-example squared norms come from ``a`` and ``g`` directly ("ghost norms"): for a linear layer
  ‖Σ_t g_tᵀa_t‖² = Σ_{t,s} (a_t·a_s)(g_t·g_s), computed as ⟨a aᵀ, g gᵀ⟩ when the sequence is short
  (T < d_in·d_out/(d_in+d_out)) and by materialising per-example gradients in chunks otherwise;
* with the clip factors c_i = min(1, C/(‖∇ℓ_i‖·(1 + 1e-5) + 1e-6)) (Opacus' formula with a relative safety
  margin for the float error of ghost norms, see :meth:`GhostClipper.clipped_sum`), the clipped sum of a linear
  weight is one matmul (c·g)ᵀa — the same cost as an ordinary weight gradient, which the custom
  autograd function below does *not* compute during backward (it only propagates input gradients);
* optionally (``materialize_bytes`` > 0, default 0), for layers applied to a sequence (T > 1), while the
  per-example gradients fit in that many bytes (in total per micro-batch), they are materialised with one
  batched matmul and give both the norms and the clipped sum (Σ_i c_i G_i, a matrix-vector product). That saves
  the B·T²·(d_in+d_out) multiply-adds of the ghost norms in theory, but on CPU the batched matmul was slower than
  ghost norms + one large matmul and needs B·d_in·d_out more floats (benchmarks/RESULTS.md §1), so it is off.

* single-query attention (the first-token-only last block, :mod:`hf_dp.models.first_token`): the key and
  value projections see T positions but feed one query, so per example and head h their output gradient is
  rank one across positions, g_{t,h} = v_{t,h} q̂_hᵀ (q̂_h a unit vector: the query for keys, the head's output
  gradient for values). Then G_h = q̂_h (Σ_t v_{t,h} a_t)ᵀ = q̂_h w_hᵀ, ‖G‖² = Σ_h ‖w_h‖², and the clipped sum is
  Σ_i c_i Σ_h q̂_{i,h} w_{i,h}ᵀ: B·H·T·d_in multiply-adds instead of the Gram products (B·T²·(d_in+d_out)) and
  the weight-gradient matmul (B·T·d_in·d_out). Code that calls these projections says so with
  :func:`single_query_heads`; the factorisation is checked (relative residual ≤ 1e-3 per example, else the
  generic path runs), and the contribution that is clipped and summed is exactly the factorised Ĝ_i whose norm
  is used, so a residual could only perturb the gradient, never the bound c_i‖Ĝ_i‖ ≤ C.

Trainable embeddings go through a custom function too (:class:`_GhostEmbedding`): backward records the token ids
and the output gradient and builds no dense, table-sized weight gradient. :meth:`GhostClipper.clipped_sum` frees
each layer's records as soon as its clipped sum exists.

So the DP step costs about one forward, one backward and the ghost norms. The result is exactly
Σ_i c_i ∇ℓ_i as Opacus would compute it (tests compare against Opacus' per-sample gradients). Its memory:
every layer's input (which autograd keeps until that layer's backward anyway) and output gradient stay
alive until the clip factors are known, at the end of backward.

**Two passes** (``two_pass=True``, ``--clipping ghost_two_pass``) keep nothing: pass 1
(:meth:`GhostClipper.norms_pass`) is a backward of Σ_i ℓ_i towards the outputs of the lowest trainable
layers only (``torch.autograd.grad``, graph retained), so autograd computes input gradients but no
weight gradient; each layer's norm terms are computed by a hook on its output as soon as its output
gradient exists (a layer called several times: once all calls have theirs) and the records are dropped.
Pass 2 is an ordinary backward of Σ_i c_i ℓ_i (c detached) through the same graph — same dropout masks —
whose parameter gradients are exactly Σ_i c_i ∇ℓ_i (:meth:`GhostClipper.grads_after_backward` takes them
from ``.grad``). Cost: one more input-gradient backward plus the norms. Memory: no records, but pass 1
holds the whole graph while its transient input gradients exist (a non-private backward frees saved
tensors as it goes) — measured (full fine-tuning, benchmarks/RESULTS.md §1) 1.10× the non-private peak where
one pass needs 1.22× at B = 128, L = 32, but 1.11× where one pass needs 1.05× at B = 32, L = 128. Float32 (or float64) layers only: in reduced precision pass 2 would round the sum across examples, so
the bound would hold only up to that rounding (one pass sums in float32). The single-query factorisation
is not used there (pass 2 sums the exact gradients, so the norms must be those of the exact gradients).

Supported trainable layers: ``nn.Linear``, transformers' ``Conv1D`` (GPT-2), ``nn.LayerNorm``,
``nn.Embedding`` (incl. broadcast position ids, see :func:`install_batch_hooks`). A layer called
several times in one forward (ALBERT's shared block) is handled by concatenating its calls along
the token axis. Rules that map each example's gradient by a public per-coordinate affine map
before clipping, v_i = (g_i + o) ⊙ s (DP-SGD-L2: o = λθ; DP-MacAdam: o = −m̂, s = 1/b), are handled
exactly (``affine=``): ‖v_i‖² expands into terms of the same records — e.g. for a linear layer
‖(G_i + O) ⊙ S‖² = ‖G_i ⊙ S‖² + 2⟨G_i, O ⊙ S²⟩ + ‖O ⊙ S‖², with ⟨G_i, O⟩ = Σ_t g_t·(O a_t) and, for one
position (T = 1), ‖G_i ⊙ S‖² = (g² S²)·a² as matmuls; per-coordinate S with T > 1 materialises the
per-example gradients (in chunks) — and Σ_i c_i v_i = (Σ_i c_i g_i + (Σ_i c_i)·o) ⊙ s. Where it
cannot apply — any other trainable layer type, parameters shared between modules —
:class:`GhostClipper` raises ``ValueError`` and the Opacus hooks must be used.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from .grad_sample import install_batch_hooks

try:  # GPT-2 style transposed linear
    from transformers.pytorch_utils import Conv1D
except Exception:  # pragma: no cover
    Conv1D = ()


#: relative safety margin on ghost norms before computing clip factors (see GhostClipper.clipped_sum)
NORM_MARGIN = 1e-5

#: largest relative residual ‖g − v q̂ᵀ‖/‖g‖ (per example) accepted for the single-query factorisation; the
#: check computes ‖g‖² − ‖v‖², which float32 v resolves to ~1e-7·‖g‖² (a genuine single query gives ~1e-7)
SINGLE_QUERY_TOL = 1e-3

_hints = threading.local()


@contextmanager
def single_query_heads(head_size: int):
    """Linear layers called inside this block feed single-query attention with heads of ``head_size``
    outputs (their output gradient is rank one across positions per example and head); ghost clipping
    then uses the factorised norms and sums (see the module docstring). Only a hint: it is checked."""
    old = getattr(_hints, "head_size", None)
    _hints.head_size = int(head_size)
    try:
        yield
    finally:
        _hints.head_size = old


class _GhostLinear(torch.autograd.Function):
    """y = x Wᵀ + b (or x W + b for Conv1D); backward returns only dL/dx and records (x, dL/dy)."""

    @staticmethod
    def forward(ctx, x, weight, bias, record, transposed, head_size=None):
        ctx.save_for_backward(x, weight)
        ctx.record = record
        ctx.transposed = transposed
        ctx.head_size = head_size
        if transposed:
            out = torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight) if bias is not None else x.reshape(-1, x.shape[-1]) @ weight
            return out.view(*x.shape[:-1], weight.shape[-1])
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        ctx.record.append((x, grad_out, ctx.head_size))
        grad_x = None
        if ctx.needs_input_grad[0]:
            w = weight.to(grad_out.dtype)  # under autocast the forward ran on a reduced-precision copy of the weight
            grad_x = (grad_out @ w.t() if ctx.transposed else grad_out @ w).to(x.dtype)
        return grad_x, None, None, None, None, None


class _GhostEmbedding(torch.autograd.Function):
    """y = weight[ids]; backward records (ids, dL/dy) and returns no weight gradient (the dense table-sized
    gradient autograd would build is never used: the clipped sum is built from the records)."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx, record):
        ctx.record = record
        ctx.save_for_backward(ids)
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        ctx.record.append((ids, grad_out))
        return None, None, None, None


def _work_dtype(*dtypes) -> torch.dtype:
    """The precision of norms and clipped sums: float64 if any operand (input, output gradient, parameter) is
    float64, else float32 — also under bf16 autocast, whose records are bf16 (never the default dtype)."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


@contextmanager
def _no_autocast():
    """Norms and clipped sums in their own precision (float32/float64), also when called inside autocast."""
    with torch.autocast("cpu", enabled=False):
        if torch.cuda.is_available():
            with torch.autocast("cuda", enabled=False):
                yield
        else:
            yield


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    """[B, ..., d] -> [B, T, d] (T = product of the middle dims, 1 for a 2-D input)."""
    if t.dim() == 2:
        return t.unsqueeze(1)
    return t.reshape(t.shape[0], -1, t.shape[-1])


class _Layer:
    def __init__(self, module: nn.Module, kind: str):
        self.module = module
        self.kind = kind  # "linear", "conv1d", "layernorm", "embedding"
        self.records: list = []  # (input, grad_output) per call, appended during backward
        self.calls = 0  # two-pass: forward calls since the last clear
        self.done = False  # two-pass: norms computed in this pass 1

    def params(self):
        return [p for p in self.module.parameters(recurse=False) if p.requires_grad]


class GhostClipper:
    """Attach to a model whose trainable parameters all live in supported layers.

    Usage per micro-batch: forward, ``loss.backward()``, then ``clipped_sum(max_grad_norm, loss_scale)``
    returns ``{param: Σ_i c_i ∇_param ℓ_i}`` and clears the records. ``per_example_norms(loss_scale)``
    gives ‖∇ℓ_i‖ (for tests and diagnostics). With ``two_pass=True``: forward, ``norms_pass(losses)``
    (‖v_i‖², no records kept), a backward of Σ_i c_i ℓ_i, ``grads_after_backward(c)`` — or
    ``two_pass_clipped_sum(losses, max_grad_norm)`` for all three.
    """

    @staticmethod
    def check_supported(model: nn.Module) -> list[tuple[nn.Module, str]]:
        """The (module, kind) pairs to instrument; ``ValueError`` if ghost clipping cannot apply."""
        layers = []
        owner: dict[int, str] = {}
        for name, m in model.named_modules():
            own = [p for p in m.parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            for p in own:
                if id(p) in owner:
                    raise ValueError(f"ghost clipping cannot handle parameters shared between modules ({owner[id(p)]} and {name})")
                owner[id(p)] = name
            if isinstance(m, nn.Linear):
                kind = "linear"
            elif Conv1D and isinstance(m, Conv1D):
                kind = "conv1d"
            elif isinstance(m, nn.LayerNorm):
                kind = "layernorm"
            elif isinstance(m, nn.Embedding):
                if m.max_norm is not None or m.scale_grad_by_freq or m.sparse:
                    raise ValueError(f"ghost clipping does not support the embedding options of {name}")
                kind = "embedding"
            else:
                raise ValueError(
                    f"ghost clipping does not support trainable layer {name} ({type(m).__name__}); "
                    "use --clipping hooks (Opacus per-sample gradients)"
                )
            layers.append((m, kind))
        if not layers:
            raise ValueError("the model has no trainable parameter")
        all_trainable = {id(p) for p in model.parameters() if p.requires_grad}
        if set(owner) != all_trainable:  # pragma: no cover - defensive
            raise ValueError("some trainable parameters are not covered by ghost clipping")
        return layers

    def __init__(self, model: nn.Module, materialize_bytes: int = 0, two_pass: bool = False):
        self.model = model
        self.two_pass = bool(two_pass)
        self.materialize_bytes = 0 if self.two_pass else int(materialize_bytes)
        self._phase: str | None = None  # two-pass: "norms" while norms_pass runs its backward
        self._roots: list = []  # two-pass: outputs of the lowest trainable layers of the current forward
        self._sq: torch.Tensor | None = None
        self._affine_now: dict = {}
        self._budget = 0
        self._grams: dict = {}
        self.batch_size: int | None = None
        self._handles: list = []
        self._patched: list[tuple[nn.Module, object]] = []
        self.layers = [_Layer(m, kind) for m, kind in self.check_supported(model)]
        self._handles.extend(install_batch_hooks(model, self))
        if self.two_pass:  # a new forward starts a new graph: forget the last one's roots and call counts
            self._handles.append(model.register_forward_pre_hook(lambda _m, _a: self.clear()))
        for layer in self.layers:
            self._instrument_two_pass(layer) if self.two_pass else self._instrument(layer)

    # ----- instrumentation -----------------------------------------------------------------------------
    def _instrument(self, layer: _Layer) -> None:
        m = layer.module
        if layer.kind in ("linear", "conv1d"):
            transposed = layer.kind == "conv1d"

            def forward(x, _m=m, _rec=layer.records, _tr=transposed):
                if not (_m.training and torch.is_grad_enabled()):
                    return type(_m).forward(_m, x)
                return _GhostLinear.apply(x, _m.weight, _m.bias, _rec, _tr, getattr(_hints, "head_size", None))

            self._patched.append((m, m.__dict__.get("forward")))
            m.forward = forward
        elif layer.kind == "embedding":

            def forward(ids, _m=m, _rec=layer.records):
                if not (_m.training and torch.is_grad_enabled()):
                    return type(_m).forward(_m, ids)
                return _GhostEmbedding.apply(ids, _m.weight, _m.padding_idx, _rec)

            self._patched.append((m, m.__dict__.get("forward")))
            m.forward = forward
        else:

            def fwd_hook(module, args, out, _rec=layer.records):
                if not (module.training and torch.is_grad_enabled()) or not out.requires_grad:
                    return
                x = args[0].detach()
                out.register_hook(lambda g, _x=x: _rec.append((_x, g)))

            self._handles.append(m.register_forward_hook(fwd_hook))

    def _instrument_two_pass(self, layer: _Layer) -> None:
        """Every layer kind keeps its own forward and backward; a forward hook notes the input and hooks
        the output's gradient, which only :meth:`norms_pass` consumes (pass 2 is an ordinary backward)."""

        def fwd_hook(module, args, out, _layer=layer):
            if not (module.training and torch.is_grad_enabled()) or not torch.is_tensor(out) or not out.requires_grad:
                return
            if out.dtype not in (torch.float32, torch.float64):
                raise ValueError(
                    f"two-pass ghost clipping needs float32 layers ({type(module).__name__} returned {out.dtype}): pass 2 "
                    "would sum the clipped per-example gradients in reduced precision across examples; use one pass"
                )
            x = args[0]
            _layer.calls += 1
            if not (x.is_floating_point() and x.requires_grad):  # nothing trainable below: a root of pass 1
                self._roots.append(out)
            x = x.detach()
            out.register_hook(lambda g, _x=x: self._on_grad(_layer, _x, g))

        self._handles.append(layer.module.register_forward_hook(fwd_hook))

    def _on_grad(self, layer: _Layer, x: torch.Tensor, g: torch.Tensor) -> None:
        if self._phase != "norms":
            return
        layer.records.append((x, g, None))  # no single-query hint: pass 2 sums the exact gradients
        if len(layer.records) == layer.calls:  # every call of the layer has its gradient: norms now, then drop
            sq, _ = self._layer_terms(layer, 1.0, self._affine_now)
            self._sq = sq if self._sq is None else self._sq + sq
            layer.records.clear()
            layer.done = True

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for m, old in self._patched:
            if old is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = old
        self._patched = []
        self.clear()

    def clear(self) -> None:
        for layer in self.layers:
            layer.records.clear()
            layer.calls = 0
            layer.done = False
        self._roots = []
        self._sq = None
        self._grams = {}

    # ----- per-layer pieces ------------------------------------------------------------------------------
    @staticmethod
    def _cat(records, scale, dtype=torch.float32):
        xs = [_as_3d(r[0]) if r[0].dim() > 1 else r[0].unsqueeze(-1) for r in records]
        gs = [_as_3d(r[1].to(dtype) if scale == 1.0 else r[1].to(dtype) / scale) for r in records]
        if len(records) == 1:
            return xs[0], gs[0]
        return torch.cat(xs, dim=1), torch.cat(gs, dim=1)

    @staticmethod
    def _affine(affine: dict, p, transpose: bool = False, dtype=torch.float32):
        """(o, s) for parameter p in ``dtype`` (s: None, a float, or a tensor), optionally transposed."""
        o, sc = affine.get(p, (None, None))
        if o is not None:
            o = o.to(dtype).t() if transpose else o.to(dtype)
        if torch.is_tensor(sc):
            sc = sc.to(dtype).t() if transpose else sc.to(dtype)
        return o, sc

    def _gram(self, a: torch.Tensor) -> torch.Tensor:
        """a aᵀ per example, computed once per input tensor (query/key/value share their input)."""
        key = (a.data_ptr(), tuple(a.shape), a.stride(), a.dtype)
        hit = self._grams.get(key)
        if hit is None:  # the entry holds a itself, so no other tensor can take its address while cached
            hit = self._grams[key] = (a, torch.bmm(a, a.transpose(1, 2)))
        return hit[1]

    @staticmethod
    def _single_query(a: torch.Tensor, g: torch.Tensor, head_size: int):
        """(q̂ [B, H, hs], w [B, H, d_in]) with g_{t,h} = v_{t,h} q̂_hᵀ and w_h = Σ_t v_{t,h} a_t, or None
        if g is not rank one across positions per example and head.

        q̂_h = the largest row of head h, normalised; v_h = g_h q̂_h. Check: since q̂ is a unit vector,
        ‖g − v q̂ᵀ‖² = ‖g‖² − ‖v‖² (summed in float64 from float32 row sums); rejected if above
        SINGLE_QUERY_TOL² · ‖g‖² for any example. Two layouts, neither copied nor squared into a
        temporary of g's size: the keys' gradient comes with positions innermost ([B, H, hs, T] in
        memory), the values' with positions outermost ([B, T, H, hs])."""
        B, T, d_out = g.shape
        if d_out % head_size:
            return None
        H = d_out // head_size

        def unit(x):
            return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)  # 0 stays 0

        if g.transpose(1, 2).is_contiguous():  # keys
            m = g.transpose(1, 2).view(B * H, head_size, T)
            row_sq = torch.zeros(B * H, T, dtype=g.dtype, device=g.device)
            for j in range(head_size):  # Σ_j m_j² without a [B, d_out, T] temporary
                row_sq.addcmul_(m[:, j], m[:, j])
            ref = torch.gather(m, 2, row_sq.argmax(1)[:, None, None].expand(B * H, head_size, 1)).squeeze(2)
            q = unit(ref)  # [B·H, hs]
            v = torch.bmm(q.unsqueeze(1), m).view(B, H, T)
            q = q.view(B, H, head_size)
        else:  # values (and anything else)
            gh = g.contiguous().view(B, T, H, head_size)
            row_sq = torch.linalg.vector_norm(gh, dim=-1).pow_(2)  # [B, T, H]
            q = unit(torch.gather(gh, 1, row_sq.argmax(1)[:, None, :, None].expand(B, 1, H, head_size)).squeeze(1))
            qd = (q.unsqueeze(-1) * torch.eye(H, dtype=g.dtype, device=g.device).unsqueeze(1)).reshape(B, d_out, H)
            v = torch.bmm(gh.view(B, T, d_out), qd).transpose(1, 2).contiguous()  # [B, H, T]; block-diagonal q: one read of g
        g_sq = row_sq.double().view(B, -1).sum(1)
        if bool((g_sq - v.double().pow(2).sum((1, 2)) > SINGLE_QUERY_TOL**2 * g_sq).any()):
            return None
        return q, torch.bmm(v, a)

    @staticmethod
    def _dense_sq(x: torch.Tensor, o, sc) -> torch.Tensor:
        """‖(x_i + o) ⊙ s‖² per row of x [B, n] (o, s flattened to n)."""
        if o is not None:
            x = x + o.reshape(1, -1)
        if sc is not None:
            x = x * (sc if isinstance(sc, float) else sc.reshape(1, -1))
        return x.pow(2).sum(1)

    def _layer_terms(self, layer: _Layer, scale: float, affine: dict | None = None):
        """(per-example ‖v_i‖² over this layer's parameters [B], function c -> {param: Σ_i c_i ∇ℓ_i}) with
        v_i = (∇ℓ_i + o) ⊙ s per parameter, (o, s) = ``affine.get(param)`` (default: v_i = ∇ℓ_i)."""
        affine = affine or {}
        m = layer.module
        if not layer.records:
            raise ValueError(f"layer {type(m).__name__} recorded no backward pass; is every trainable layer used in the forward?")
        dt = _work_dtype(*(t.dtype for r in layer.records for t in r[:2]), *(p.dtype for p in layer.params()))
        if layer.kind in ("linear", "conv1d"):
            a, g = self._cat(layer.records, scale, dt)
            a = a.to(dt)
            B, T, d_in = a.shape
            d_out = g.shape[-1]
            sq = torch.zeros(B, device=g.device, dtype=dt)
            per_example = factored = None
            if m.weight.requires_grad:
                o, sc = self._affine(affine, m.weight, transpose=layer.kind == "conv1d", dtype=dt)  # as [d_out, d_in]
                s2 = 1.0
                if isinstance(sc, float):  # a scalar scale: ‖(G + o)s‖² = s²‖G + o‖²
                    s2, sc = sc * sc, None
                wsq = None
                head_size = layer.records[0][2] if len(layer.records) == 1 else None
                if head_size and T > 1 and o is None and sc is None:  # single-query attention (checked)
                    factored = self._single_query(a, g, head_size)
                if factored is not None:
                    wsq = factored[1].pow(2).sum((1, 2))  # ‖G_i‖² = Σ_h ‖w_{i,h}‖² (q̂ unit)
                elif T > 1 and 4 * B * d_in * d_out <= self._budget:
                    # materialise: one batched matmul (the cost of the ordinary weight gradient) gives both
                    # the norms and, later, the clipped sum as a cheap weighted sum over examples
                    self._budget -= 4 * B * d_in * d_out
                    per_example = torch.bmm(g.transpose(1, 2), a).view(B, -1)  # [B, d_out * d_in]
                    wsq = self._dense_sq(per_example, o, sc)
                elif sc is not None and T == 1:  # rank one: Σ_jk g_j² a_k² s_jk² (+ cross terms) as matmuls
                    g1, a1 = g[:, 0], a[:, 0]
                    wsq = ((g1.pow(2) @ sc.pow(2)) * a1.pow(2)).sum(1)
                    if o is not None:
                        wsq = wsq + 2 * ((g1 @ (o * sc.pow(2))) * a1).sum(1) + (o * sc).pow(2).sum()
                elif sc is not None:  # per-coordinate scale, T > 1: materialise in chunks for the norms only
                    chunk = max(1, int(2**26 // (d_in * d_out)))
                    wsq = torch.cat([self._dense_sq(torch.bmm(g[i : i + chunk].transpose(1, 2), a[i : i + chunk]).flatten(1), o, sc) for i in range(0, B, chunk)])
                else:
                    if T * T * (d_in + d_out) <= T * d_in * d_out:
                        wsq = (self._gram(a) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))
                    else:
                        chunk = max(1, int(2**26 // (d_in * d_out)))
                        parts = [torch.einsum("bto,bti->boi", g[i : i + chunk], a[i : i + chunk]).flatten(1).pow(2).sum(1) for i in range(0, B, chunk)]
                        wsq = torch.cat(parts)
                    if o is not None:  # ‖G + o‖² = ‖G‖² + 2⟨G, o⟩ + ‖o‖², ⟨G_i, o⟩ = Σ_t g_t·(o a_t)
                        wsq = wsq + 2 * (torch.matmul(a, o.t()) * g).sum((1, 2)) + o.pow(2).sum()
                sq = sq + s2 * wsq
            gsum = None
            if m.bias is not None and m.bias.requires_grad:
                gsum = g.sum(1)
                sq = sq + self._dense_sq(gsum, *self._affine(affine, m.bias, dtype=dt))

            def clipped(c, a=a, g=g, gsum=gsum, per_example=per_example, factored=factored):
                c = c.to(dt)
                out = {}
                if factored is not None:  # Σ_i c_i Σ_h q̂_{i,h} w_{i,h}ᵀ, heads stacked along d_out
                    qhat, w = factored
                    w = torch.einsum("bhd,bhi->hdi", qhat * c.view(-1, 1, 1), w).reshape(d_out, d_in)
                    out[m.weight] = (w.t() if layer.kind == "conv1d" else w).to(m.weight.dtype)
                elif per_example is not None:
                    w = torch.mv(per_example.t(), c).view(d_out, d_in)
                    out[m.weight] = (w.t() if layer.kind == "conv1d" else w).to(m.weight.dtype)
                elif m.weight.requires_grad:
                    cg = (g * c.view(-1, 1, 1)).reshape(-1, d_out)
                    w = cg.t() @ a.reshape(-1, d_in)  # [d_out, d_in]
                    out[m.weight] = (w.t() if layer.kind == "conv1d" else w).to(m.weight.dtype)
                if gsum is not None:
                    out[m.bias] = (gsum * c.view(-1, 1)).sum(0).to(m.bias.dtype)
                return out

            return sq, clipped
        if layer.kind == "layernorm":
            x, g = self._cat(layer.records, scale, dt)
            xhat = F.layer_norm(x.to(dt), m.normalized_shape, eps=m.eps)
            sq = torch.zeros(g.shape[0], device=g.device, dtype=dt)
            gw = gb = None
            if m.weight is not None and m.weight.requires_grad:
                gw = (g * xhat).sum(1)
                sq = sq + self._dense_sq(gw, *self._affine(affine, m.weight, dtype=dt))
            if m.bias is not None and m.bias.requires_grad:
                gb = g.sum(1)
                sq = sq + self._dense_sq(gb, *self._affine(affine, m.bias, dtype=dt))

            def clipped(c, gw=gw, gb=gb):
                c = c.to(dt)
                out = {}
                if gw is not None:
                    out[m.weight] = (gw * c.view(-1, 1)).sum(0).to(m.weight.dtype)
                if gb is not None:
                    out[m.bias] = (gb * c.view(-1, 1)).sum(0).to(m.bias.dtype)
                return out

            return sq, clipped
        # embedding: per-example gradient rows are sums of g over equal token ids
        ids = torch.cat([r[0].reshape(r[0].shape[0], -1) for r in layer.records], dim=1)
        g = torch.cat([_as_3d(r[1].to(dt) / scale) for r in layer.records], dim=1)
        if m.padding_idx is not None:
            g = g * (ids != m.padding_idx).unsqueeze(-1)
        same = ids.unsqueeze(2) == ids.unsqueeze(1)
        o, sc = self._affine(affine, m.weight, dtype=dt)
        s2 = 1.0
        if isinstance(sc, float):
            s2, sc = sc * sc, None
        gs = g if sc is None else g * sc[ids]  # row id_t of the per-example gradient, scaled
        sq = (torch.bmm(gs, gs.transpose(1, 2)) * same).sum((1, 2))
        if o is not None:  # 2⟨G_i, o ⊙ s²⟩ + ‖o ⊙ s‖² (o covers every row of the table)
            os2 = o if sc is None else o * sc.pow(2)
            sq = sq + 2 * (g * os2[ids]).sum((1, 2)) + (o if sc is None else o * sc).pow(2).sum()
        sq = s2 * sq

        def clipped(c, ids=ids, g=g):
            c = c.to(dt)
            w = torch.zeros(m.weight.shape, device=g.device, dtype=dt)
            w.index_add_(0, ids.reshape(-1), (g * c.view(-1, 1, 1)).reshape(-1, g.shape[-1]))
            return {m.weight: w.to(m.weight.dtype)}

        return sq, clipped

    # ----- public -----------------------------------------------------------------------------------------
    def _collect(self, loss_scale: float, affine: dict | None = None, release: bool = False):
        self._budget = self.materialize_bytes
        if affine:
            owned = {id(p) for layer in self.layers for p in layer.params()}
            if any(id(p) not in owned for p in affine):
                raise ValueError("per-sample transform given for a parameter ghost clipping does not cover")
        self._grams: dict = {}
        try:
            with _no_autocast():
                terms = []
                for layer in self.layers:
                    terms.append(self._layer_terms(layer, loss_scale, affine))
                    if release:  # the terms keep what they need (a scaled copy of g, when loss_scale != 1)
                        layer.records.clear()
        finally:
            self._grams = {}
        sq = terms[0][0]
        for t in terms[1:]:
            sq = sq + t[0]
        return sq, terms

    @torch.no_grad()
    def per_example_norms(self, loss_scale: float = 1.0, affine: dict | None = None) -> torch.Tensor:
        """‖v_i‖ per example, v_i = ∇ℓ_i or its per-parameter affine transform (see :meth:`clipped_sum`)."""
        if self.two_pass:
            raise RuntimeError("a two-pass GhostClipper gives the norms from norms_pass")
        return self._collect(loss_scale, affine)[0].clamp_min(0).sqrt()

    @torch.no_grad()
    def clipped_sum(self, max_grad_norm: float, loss_scale: float = 1.0, affine: dict | None = None) -> dict:
        """{param: Σ_i min(1, C/(‖v_i‖+1e-6)) v_i}; clears the records.

        v_i = ∇ℓ_i, or with ``affine={param: (o, s)}`` the per-sample vector of rules that transform
        each example's gradient by a public per-coordinate map before clipping: v_i = (∇ℓ_i + o) ⊙ s
        (o, s: tensors of the parameter's shape, s also a float, either ``None``) — DP-SGD-L2: o = λθ;
        DP-MacAdam: o = −m̂_{t−1}, s = 1/b_{t−1}. Exact: the norms expand into terms of the same
        records, and Σ_i c_i v_i = (Σ_i c_i ∇ℓ_i + (Σ_i c_i)·o) ⊙ s.
        """
        if self.two_pass:
            raise RuntimeError("a two-pass GhostClipper computes norms in norms_pass (see two_pass_clipped_sum)")
        sq, terms = self._collect(loss_scale, affine, release=True)
        c = clip_factors(sq, max_grad_norm)
        out: dict = {}
        with _no_autocast():
            terms.reverse()
            while terms:  # each layer's activations and output gradients are freed once its clipped sum exists
                out.update(terms.pop()[1](c))
            out = self._apply_affine(out, c, affine)
        self.clear()
        return out

    @staticmethod
    def _apply_affine(out: dict, c: torch.Tensor, affine: dict | None) -> dict:
        """Σ_i c_i v_i = (Σ_i c_i ∇ℓ_i + (Σ_i c_i)·o) ⊙ s for the parameters with a per-sample affine map."""
        for p, (o, sc) in (affine or {}).items():
            dt = _work_dtype(out[p].dtype, p.dtype)
            v = out[p].to(dt)
            if o is not None:
                v = v + c.to(dt).sum() * o.to(dt)
            if sc is not None:
                v = v * (sc if isinstance(sc, float) else sc.to(dt))
            out[p] = v.to(out[p].dtype)
        return out

    # ----- two passes (two_pass=True): no records kept (≈ 1.1× the non-private memory, see above) -----------
    def norms_pass(self, losses: torch.Tensor, affine: dict | None = None) -> torch.Tensor:
        """Pass 1 of two: ‖v_i‖² per example (``losses``: the per-example losses ℓ_i, shape [B]).

        One backward of Σ_i ℓ_i that computes no parameter gradient (``torch.autograd.grad`` towards the
        outputs of the lowest trainable layers only, so autograd skips every weight-gradient product) and
        keeps the graph; each layer's norm terms are computed from its input and output gradient as soon as
        they are known and then dropped, so nothing accumulates. Pass 2 is an ordinary backward of
        Σ_i c_i ℓ_i (c from :func:`clip_factors`, detached) through the same graph — same dropout masks —
        whose parameter gradients are exactly Σ_i c_i ∇ℓ_i; :meth:`grads_after_backward` collects them.
        The per-sample affine maps (``affine``, see :meth:`clipped_sum`) enter the norms here and the sum there."""
        if not self.two_pass:
            raise RuntimeError("norms_pass needs GhostClipper(two_pass=True)")
        if affine:
            owned = {id(p) for layer in self.layers for p in layer.params()}
            if any(id(p) not in owned for p in affine):
                raise ValueError("per-sample transform given for a parameter ghost clipping does not cover")
        if not self._roots:
            raise ValueError("norms_pass needs a training-mode forward of the model (with grad enabled) first")
        self._phase, self._affine_now, self._sq, self._grams = "norms", affine or {}, None, {}
        try:
            torch.autograd.grad(losses.sum(), self._roots, retain_graph=True, allow_unused=True)
            missing = [type(layer.module).__name__ for layer in self.layers if not layer.done]
            if missing:
                raise ValueError(f"layers {missing} got no gradient in pass 1; is every trainable layer used in the forward?")
            return self._sq
        finally:
            self._phase, self._affine_now = None, {}
            self.clear()

    def grads_after_backward(self, c: torch.Tensor, loss_scale: float = 1.0, affine: dict | None = None) -> dict:
        """After pass 2 (a backward of ``loss_scale`` · Σ_i c_i ℓ_i): {param: Σ_i c_i v_i} from the parameters'
        ``.grad``, which are reset to ``None``."""
        out = {}
        for layer in self.layers:
            for p in layer.params():
                if p.grad is None:
                    raise ValueError("a trainable parameter got no gradient in pass 2")
                out[p] = p.grad if loss_scale == 1.0 else p.grad / loss_scale
                p.grad = None
        return self._apply_affine(out, c, affine)

    def two_pass_clipped_sum(self, losses: torch.Tensor, max_grad_norm: float, affine: dict | None = None) -> dict:
        """Both passes after a forward: {param: Σ_i min(1, C/(‖v_i‖+1e-6)) v_i} (as :meth:`clipped_sum`)."""
        c = clip_factors(self.norms_pass(losses, affine), max_grad_norm)
        (losses * c).sum().backward()
        return self.grads_after_backward(c, 1.0, affine)


def clip_factors(sq: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """c_i = min(1, C/(‖v_i‖·(1 + NORM_MARGIN) + 1e-6)) from squared ghost norms, detached.

    Ghost norms are sums of terms of both signs (Gram products, the affine expansion), so their float32
    error can exceed a plain sum of squares'; the relative margin keeps c_i·‖v_i‖ ≤ C when the computed
    norm is up to 1e-5 (relative) short of the exact one."""
    norms = sq.detach().clamp_min(0).sqrt() * (1.0 + NORM_MARGIN)
    return (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
