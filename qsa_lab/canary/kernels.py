"""Kernels the canary can run, and the adapter protocol for your own.

A kernel is any callable `fn(call: PagedCall) -> Tensor [rows, q_heads, head_dim]`. It gets
one paged-attention call (the query rows, the paged pool in its storage dtype, block table,
seq_lens, positions, selections, scales) and returns the attention output of every row; the
dtype is free (compared bit for bit against the same kernel's control run). It may raise
`KernelSkipped("why")` when it cannot run here; the canary reports that reason.

Built in:
    qsa:<route>          every qsa_lab route (reference, xqa, grouped and its fixes), on the
                         chosen backend (compiled kernels or the emulation)
    torch:sdpa-math      scaled_dot_product_attention over WHOLE pages of each row's block
    torch:sdpa-efficient table (decoded to fp16 with the scales), unattended slots masked by a
    torch:sdpa-cudnn     boolean mask; the named backend forced with sdpa_kernel. All but math
    torch:sdpa-flash     need a CUDA GPU.
    torch:sdpa-cut       SDPA over each row's keys cut at the attended length (no mask):
                         never reads an unattended slot; needs prefix attention (dense case)
    torch:flex           FlexAttention with a block mask over the same whole pages
                         (eager on the CPU, torch.compile on a GPU)
    torch:flex-paged     torch's experimental paged FlexAttention reading the pool itself
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from .. import fp8
from ..regions import SPARSE, AttentionSpec, attended_tokens


class KernelSkipped(Exception):
    """Raised by a kernel that cannot run here (no GPU, shapes refused): the reason is reported."""


PLANE_INDEX = {"k": 0, "v": 1, 0: 0, 1: 1}


def plane_index(plane) -> int:
    """'k' | 'v' | 0 | 1 -> 0 (K) or 1 (V)."""
    if isinstance(plane, bool) or plane not in PLANE_INDEX:
        raise ValueError(f"plane: must be 'k', 'v', 0 or 1, got {plane!r}")
    return PLANE_INDEX[plane]


@dataclass
class PagedCall:
    """One paged-attention call, tensors on `device` (each call gets its own fresh copies).

    q            [rows, q_heads, head_dim] fp16
    kv_cache     [pages, 2, page_size, kv_heads, head_dim] fp16, or uint8 fp8 codes (kv_dtype
                 e4m3 / e5m2); index 0 of dim 1 is K, 1 is V; value = decode(element) * scale.
                 GQA: query head h reads KV head h // (q_heads // kv_heads)
    k_scale, v_scale  float per-tensor scales; sm_scale the softmax scale
    block_table  [requests, max_pages] int32: logical page -> physical page; entries past a
                 request's last page are 0 (the null block)
    seq_lens     [requests] int32 tokens written per request
    token_to_req [rows] int32, positions [rows] int64
    selected     [rows, topk] int32 logical 4-token block ids, -1 unused (sparse selection)
    spec         qsa_lab.regions.AttentionSpec: what each row attends (attend_mask() is it)
    mla          MLA mode: plane 0 holds the latent (read as K, head_dim = latent + rope) and
                 V is its first `v_head_dim` dims; plane 1 unused. Output [rows, q_heads, v_head_dim]
    memo         a dict shared by every call of one kernel in one canary run: they differ only
                 in the pool's bytes, so anything derived from the rest (masks, tables) can be
                 cached here (`cached`)

    Layout: rows are grouped by request in request order; a request's query rows are its
    LAST positions (row i of a request with n rows: position seq_len - n + i). Decode is one
    row per request; a prefill chunk is several (query_lens(), qo_indptr()).
    The kernel returns [rows, q_heads, head_dim] (v_head_dim in MLA mode), any float dtype,
    on `device`: it is compared bit for bit against the same kernel's control run.
    """

    q: torch.Tensor
    kv_cache: torch.Tensor
    k_scale: float
    v_scale: float
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    token_to_req: torch.Tensor
    positions: torch.Tensor
    selected: torch.Tensor
    sm_scale: float
    kv_dtype: str
    spec: AttentionSpec = SPARSE
    mla: bool = False
    v_head_dim: int | None = None
    memo: dict = field(default_factory=dict, repr=False)
    geometry: object = field(default=None, repr=False)

    @classmethod
    def from_case(cls, case, device="cpu", memo: dict | None = None) -> "PagedCall":
        """From a CanaryCase or a qsa_lab Case (its tensors, moved to `device`; not copied)."""
        from .case import as_canary_case

        c = as_canary_case(case)
        c = c.to(device) if str(device) != str(c.device) else c
        return cls(c.q, c.kv_cache, float(c.k_scale), float(c.v_scale), c.block_table, c.seq_lens, c.token_to_req,
                   c.positions, c.selected, float(c.sm_scale), c.kv_dtype, c.spec, c.mla, c.v_head_dim,
                   {} if memo is None else memo, c.geometry)

    def cached(self, key: str, make: Callable):
        """memo[key], computed by make() on first use."""
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    # -- shape --------------------------------------------------------------------------------------
    device = property(lambda self: self.q.device)
    rows = property(lambda self: int(self.q.shape[0]))
    q_heads = property(lambda self: int(self.q.shape[1]))
    requests = property(lambda self: int(self.seq_lens.shape[0]))
    page_size = property(lambda self: int(self.kv_cache.shape[2]))
    kv_heads = property(lambda self: int(self.kv_cache.shape[3]))
    head_dim = property(lambda self: int(self.kv_cache.shape[4]))

    @property
    def out_dim(self) -> int:
        return self.v_head_dim if self.mla else self.head_dim

    @property
    def case(self):
        """This call as a CanaryCase (CPU; the same tensors when the call is on the CPU)."""
        from .case import CanaryCase

        return CanaryCase(*(t.cpu() for t in (self.q, self.kv_cache)), self.k_scale, self.v_scale,
                          *(t.cpu() for t in (self.block_table, self.seq_lens, self.token_to_req, self.positions,
                                              self.selected)),
                          kv_dtype=self.kv_dtype, spec=self.spec, sm_scale=self.sm_scale, mla=self.mla,
                          v_head_dim=self.v_head_dim, geometry=self.geometry)

    def to_case(self):
        """The qsa_lab Case of this call (what the qsa routes run; one KV head only)."""
        return self.case.to_case()

    # -- tables adapters rebuild ----------------------------------------------------------------------
    def query_lens(self) -> torch.Tensor:
        """[requests] int32: query rows per request."""
        return self.cached("query_lens", lambda: torch.bincount(
            self.token_to_req.long(), minlength=self.requests).to(torch.int32))

    def qo_indptr(self) -> torch.Tensor:
        """[requests + 1] int32: cumulative query rows (request r's rows are qo_indptr[r]:qo_indptr[r+1])."""
        return self.cached("qo_indptr", lambda: _indptr(self.query_lens()))

    def kv_indptr(self) -> torch.Tensor:
        """[requests + 1] int32: cumulative seq_lens."""
        return self.cached("kv_indptr", lambda: _indptr(self.seq_lens))

    def page_table(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """FlashInfer's paged layout, only each request's used pages (never a padding entry):
        (indptr [requests + 1] int32, indices [nnz] int32 physical pages, last_page_len [requests] int32)."""
        def make():
            ps, seq = self.page_size, self.seq_lens.long()
            used = -(-seq // ps)
            keep = torch.arange(self.block_table.shape[1], device=seq.device).unsqueeze(0) < used.unsqueeze(1)
            return _indptr(used), self.block_table[keep].to(torch.int32), (seq - (used - 1) * ps).to(torch.int32)
        return self.cached("page_table", make)

    def row_slots(self) -> torch.Tensor:
        """[rows, max_pages * page_size] int64 (CPU): physical token ids (page * page_size + slot)
        of the whole pages of each row's block table, in logical order (what a paged kernel walks)."""
        def make():
            ps = self.page_size
            pages = self.block_table.cpu().long()[self.token_to_req.cpu().long()]        # [rows, max_pages]
            return (pages.unsqueeze(-1) * ps + torch.arange(ps)).flatten(1)
        return self.cached("row_slots", make)

    def attend(self) -> torch.Tensor:
        """[rows, max_pages * page_size] bool (CPU): which of row_slots() the row attends,
        i.e. qsa_lab.regions.attended_tokens of this call (the spec's definition)."""
        return self.cached("attend", lambda: attended_tokens(self))

    def attend_mask(self) -> torch.Tensor:
        """attend() on `device`: [rows, max_tokens] bool over each row's logical positions."""
        return self.cached("attend_mask", lambda: self.attend().to(self.device))

    def pages(self, plane, heads: str = "kv") -> torch.Tensor:
        """[rows, max_pages * page_size, H, head_dim] fp16 on `device`: decoded values (scale
        applied) of row_slots() on plane "k" / 0 or "v" / 1; H = kv_heads, or q_heads with
        heads="q" (each KV head repeated for its query heads). MLA: both planes read the
        latent, "v" its first v_head_dim dims."""
        p = plane_index(plane)
        vals = self.pool(p)[self.row_slots().to(self.device)]
        if self.mla and p == 1:
            vals = vals[..., :self.v_head_dim]
        if heads == "q":
            vals = vals.repeat_interleave(self.q_heads // self.kv_heads, dim=2)
        elif heads != "kv":
            raise ValueError(f"heads: must be 'kv' or 'q', got {heads!r}")
        return vals

    def pool(self, plane) -> torch.Tensor:
        """[pages * page_size, kv_heads, head_dim] fp16 on `device`: the whole pool's decoded
        values of one plane (MLA: plane 0 for both K and V)."""
        p = plane_index(plane)
        src = 0 if self.mla else p
        scale = self.k_scale if src == 0 else self.v_scale
        raw = self.kv_cache[:, src]
        vals = raw.float() if self.kv_dtype == "fp16" else fp8.decode(raw, self.kv_dtype)
        return (vals * scale).to(torch.float16).flatten(0, 1)


def _indptr(counts: torch.Tensor) -> torch.Tensor:
    return torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).to(torch.int32)


# -- qsa_lab routes --------------------------------------------------------------------------------

def qsa_kernel(route: str, backend: str) -> Callable:
    def run(call: PagedCall) -> torch.Tensor:
        from ..case import validate_case
        from ..plan import plan_groups
        from ..routes import run_routes_planned

        # the calls of one canary run differ only in the pool's bytes: the case is checked and
        # planned once (the plan and token lists do not read the pool)
        case = call.to_case()

        def planned():
            validate_case(case)
            return plan_groups(case.to("cuda" if backend == "cuda" else "cpu"))
        plan = call.cached("qsa.plan", planned)
        out = run_routes_planned(case, [route], backend, plan, reference=route == "reference",
                                 memo=call.cached("qsa.tokens", dict)).outputs[route]
        return out.to(call.device)   # routes return CPU tensors; a kernel answers on its call's device
    if route.startswith("grouped"):
        run.paged_inputs = "padded_plan"   # its plan pads every category with the null block
    return run


# -- PyTorch SDPA and FlexAttention over whole pages ----------------------------------------------

SDPA_BACKENDS = {"math": "MATH", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "flash": "FLASH_ATTENTION"}


def _dense_inputs(call: PagedCall):
    """q [rows, Hq, 1, D]; K, V [rows, Hq, S, D] (each KV head repeated for its query heads,
    materialised: some fused backends refuse a zero head stride); mask [rows, 1, 1, S]."""
    k = call.pages("k", heads="q").transpose(1, 2).contiguous()
    v = call.pages("v", heads="q").transpose(1, 2).contiguous()
    return call.q.unsqueeze(2), k, v, call.attend_mask().view(call.rows, 1, 1, -1)


def sdpa_kernel(name: str) -> Callable:
    def run(call: PagedCall) -> torch.Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel as force

        if name != "math" and call.device.type != "cuda":
            raise KernelSkipped(f"SDPA backend {name!r} needs a CUDA GPU")
        q, k, v, mask = _dense_inputs(call)
        try:
            with force(getattr(SDPBackend, SDPA_BACKENDS[name])):
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                       scale=call.sm_scale)
        except RuntimeError as e:  # the forced backend refuses these inputs (e.g. flash takes no mask)
            raise KernelSkipped(f"SDPA backend {name!r} refused the inputs: {_first_line(e)}") from e
        return out.squeeze(2)
    return run


def sdpa_cut(call: PagedCall) -> torch.Tensor:
    attend = call.attend()
    n = attend.sum(-1)
    if not torch.equal(attend, torch.arange(attend.shape[1]) < n.unsqueeze(1)):
        raise KernelSkipped("sdpa-cut needs every row to attend a prefix of its pages (a dense case)")
    q, k, v, _ = _dense_inputs(call)
    outs = [torch.nn.functional.scaled_dot_product_attention(q[r:r + 1], k[r:r + 1, :, :int(n[r])],
                                                              v[r:r + 1, :, :int(n[r])], scale=call.sm_scale)
            for r in range(q.shape[0])]
    return torch.cat(outs).squeeze(2)


@functools.lru_cache(maxsize=None)
def _flex_fn(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    # on a GPU the compiled kernel is the one people ship; on the CPU eager is the point
    # (and quick to start), so its "called without torch.compile" warning is silenced
    if device_type == "cuda":
        return torch.compile(flex_attention, dynamic=False)

    def eager(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex_attention(*args, **kwargs)
    return eager


def flex(call: PagedCall) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v, mask = _dense_inputs(call)
    attend = mask.view(mask.shape[0], -1)

    def mask_mod(b, h, q_idx, kv_idx):
        return attend[b, kv_idx]

    block_mask = call.cached("flex.block_mask", lambda: create_block_mask(
        mask_mod, B=q.shape[0], H=None, Q_LEN=1, KV_LEN=k.shape[2], device=str(call.device)))
    return _flex_fn(call.device.type)(q, k, v, block_mask=block_mask, scale=call.sm_scale).squeeze(2)


def _paged_block_mask(call: PagedCall):
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask

    dev, rows, ps = call.device, call.rows, call.page_size
    pages = int(call.kv_cache.shape[0])
    attend = call.attend()                                                  # [rows, max_pages * ps] logical
    paged = PagedAttention(pages, ps, rows, device=dev)
    req = call.token_to_req.cpu().long()
    table = call.block_table.cpu().long()[req]                             # [rows, max_pages]
    used = torch.arange(table.shape[1]) < -(-call.seq_lens.cpu().long()[req] // ps).unsqueeze(1)
    paged.page_table[:, :table.shape[1]] = table.to(dev)                  # padding entries stay 0: the null block
    for r in range(rows):
        paged.physical_to_logical[r, table[r][used[r]].to(dev)] = torch.arange(int(used[r].sum()), device=dev)
    attend_dev = attend.to(dev)
    width = attend.shape[1]

    def mask_mod(b, h, q_idx, kv_idx):
        # the paged wrapper also evaluates this for dead blocks (logical index < 0) and
        # discards the answer: clamp so that no index leaves the mask
        return attend_dev[b, kv_idx.clamp(0, width - 1)]

    logical = create_block_mask(mask_mod, B=rows, H=None, Q_LEN=1, KV_LEN=attend.shape[1], BLOCK_SIZE=ps,
                                device=str(dev))
    return paged.convert_logical_block_mask(logical)


def flex_paged(call: PagedCall) -> torch.Tensor:
    """torch.nn.attention.experimental PagedAttention: the pool itself is the key sequence;
    a logical block mask (block size = page_size) is mapped to physical pages."""
    dev, rows, hq, ps = call.device, call.rows, call.q_heads, call.page_size
    block_mask = call.cached("flex-paged.block_mask", lambda: _paged_block_mask(call))
    group = hq // call.kv_heads

    def plane(p):  # [rows, Hq, pages * ps, D]: the whole pool, each KV head repeated for its query heads
        vals = call.pool(p).repeat_interleave(group, dim=1)
        if call.mla and p == 1:
            vals = vals[..., :call.v_head_dim]
        return vals.transpose(0, 1).unsqueeze(0).expand(rows, -1, -1, -1).contiguous()

    run = functools.partial(_flex_fn(dev.type), call.q.unsqueeze(2), plane(0), plane(1), block_mask=block_mask,
                            scale=call.sm_scale)
    try:
        return run().squeeze(2)
    except Exception as first:  # noqa: BLE001 - compiled kernels may want a KV tile no larger than a page
        if dev.type != "cuda":
            raise
        try:
            return run(kernel_options={"BLOCK_N": ps}).squeeze(2)
        except Exception as e:  # noqa: BLE001
            raise KernelSkipped(f"paged FlexAttention refused the inputs: {_first_line(first)}; "
                                f"with BLOCK_N={ps}: {_first_line(e)}") from e


TORCH_KERNELS = {"torch:sdpa-math": sdpa_kernel("math"), "torch:sdpa-efficient": sdpa_kernel("efficient"),
                 "torch:sdpa-cudnn": sdpa_kernel("cudnn"), "torch:sdpa-flash": sdpa_kernel("flash"),
                 "torch:sdpa-cut": sdpa_cut, "torch:flex": flex, "torch:flex-paged": flex_paged}


#: name prefixes of the built-in third-party kernels (qsa_lab.canary.adapters: FlashInfer, vLLM)
THIRD_PARTY = ("flashinfer:", "vllm:")
#: kernels other modules add by name (e.g. adapters of other libraries): name -> fn(PagedCall)
REGISTERED: dict = {}


def register_kernel(name: str, fn: Callable) -> None:
    """Make `name` (e.g. 'flashinfer:decode') a built-in kernel, run in this process."""
    if not isinstance(name, str) or ":" not in name or name.startswith(("qsa:", "torch:")):
        raise ValueError(f"name: expected 'library:kernel' outside qsa: / torch:, got {name!r}")
    REGISTERED[name] = fn


def registered() -> dict:
    return dict(REGISTERED)


def builtin_kernels() -> tuple:
    from ..routes import ROUTES

    return tuple(f"qsa:{r}" for r in ROUTES) + tuple(TORCH_KERNELS) + tuple(REGISTERED)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def kernel_name(kernel) -> str:
    """A kernel's name: the string itself, a callable's `canary_name` attribute or module:qualname."""
    if isinstance(kernel, str):
        return kernel
    given = getattr(kernel, "canary_name", None)
    if isinstance(given, str) and given:
        return given
    return f"{getattr(kernel, '__module__', '?')}:{getattr(kernel, '__qualname__', repr(kernel))}"


def resolve_kernel(kernel, qsa_backend: str | None, qsa_reason: str | None = None) -> Callable:
    """A kernel name or callable -> callable(PagedCall). `qsa_backend` None means the qsa routes
    cannot run here (`qsa_reason` says why)."""
    if callable(kernel):
        return kernel
    if not isinstance(kernel, str):
        raise TypeError(f"kernels: expected names or callables, got {type(kernel).__name__}")
    if kernel.startswith("qsa:"):
        from ..routes import ROUTES

        route = kernel[4:]
        if route not in ROUTES:
            raise ValueError(f"kernels: unknown qsa route {route!r}; choose from {ROUTES}")
        if qsa_backend is None:
            def unavailable(call):
                raise KernelSkipped(qsa_reason)
            return unavailable
        return qsa_kernel(route, qsa_backend)
    if kernel.startswith("torch:"):
        if kernel not in TORCH_KERNELS:
            raise ValueError(f"kernels: unknown torch kernel {kernel!r}; choose from {tuple(TORCH_KERNELS)}")
        return TORCH_KERNELS[kernel]
    if kernel in REGISTERED:
        return REGISTERED[kernel]
    if kernel.startswith(THIRD_PARTY):  # built-in third-party kernels (canary.adapters), not in the default run
        from .adapters import resolve

        return resolve(kernel)
    raise ValueError(f"kernels: {kernel!r} is not a known kernel nor module:function / file.py:function")
