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
import importlib
import importlib.util
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..case import Case, token_values
from ..plan import INT64_MAX, xqa_tokens


class KernelSkipped(Exception):
    """Raised by a kernel that cannot run here (no GPU, shapes refused): the reason is reported."""


@dataclass
class PagedCall:
    """One paged-attention call, tensors on `device`.

    q            [rows, q_heads, head_dim] fp16
    kv_cache     [pages, 2, page_size, 1, head_dim] uint8 fp8 codes (kv_dtype e4m3/e5m2) or fp16;
                 index 0 of dim 1 is K, 1 is V; value = decode(element) * scale
    k_scale, v_scale  float per-tensor scales
    block_table  [requests, max_pages] int32: logical page -> physical page; entries past a
                 request's last page are 0 (the null block)
    seq_lens     [requests] int32 tokens written per request
    token_to_req [rows] int32, positions [rows] int64 (a row sees tokens <= its position)
    selected     [rows, topk] int32 logical 4-token block ids, -1 unused (sparse selection)
    sm_scale     softmax scale; kv_dtype "e4m3" | "e5m2" | "fp16"
    case         the qsa_lab Case the call was built from (CPU)
    memo         a dict shared by every call of one kernel in one canary run: they differ only
                 in the pool's bytes, so anything derived from the rest (masks) can be cached here
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
    case: Case
    memo: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_case(cls, case: Case, device="cpu", memo: dict | None = None) -> "PagedCall":
        c = case.to(device) if str(device) != "cpu" else case
        return cls(c.q, c.kv_cache, c.k_scale, c.v_scale, c.block_table, c.seq_lens, c.token_to_req,
                   c.positions, c.selected, case.sm_scale, case.kv_format, case, {} if memo is None else memo)

    def cached(self, key: str, make: Callable):
        """memo[key], computed by make() on first use."""
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    @property
    def device(self) -> torch.device:
        return self.q.device

    def row_slots(self) -> torch.Tensor:
        """[rows, max_pages * page_size] int64: physical token ids of the whole pages of each
        row's block table, in logical order (what a paged kernel walks)."""
        ps = self.kv_cache.shape[2]
        pages = self.case.block_table.long()[self.case.token_to_req.long()]            # [rows, max_pages]
        return (pages.unsqueeze(-1) * ps + torch.arange(ps)).flatten(1)

    def attend(self) -> torch.Tensor:
        """[rows, max_pages * page_size] bool: which of row_slots() the row attends (CPU)."""
        def make():
            tok, _ = xqa_tokens(self.case)
            tok = torch.where(tok == INT64_MAX, -1, tok)  # unused slots match no physical token
            return (self.row_slots().unsqueeze(-1) == tok.unsqueeze(1)).any(-1)
        return self.cached("attend", make)

    def pages(self, plane: int) -> torch.Tensor:
        """[rows, max_pages * page_size, head_dim] fp16 on `device`: decoded values (scale
        applied) of row_slots() on plane 0 = K or 1 = V."""
        scale = self.case.k_scale if plane == 0 else self.case.v_scale
        vals = token_values(self.case.kv_cache, self.row_slots(), plane, self.kv_dtype) * scale
        return vals.to(torch.float16).to(self.device)


# -- qsa_lab routes --------------------------------------------------------------------------------

def qsa_kernel(route: str, backend: str) -> Callable:
    def run(call: PagedCall) -> torch.Tensor:
        from ..case import validate_case
        from ..plan import plan_groups
        from ..routes import run_routes_planned

        # the calls of one canary run differ only in the pool's bytes: the case is checked and
        # planned once (the plan and token lists do not read the pool)
        def planned():
            validate_case(call.case)
            return plan_groups(call.case.to("cuda" if backend == "cuda" else "cpu"))
        plan = call.cached("qsa.plan", planned)
        return run_routes_planned(call.case, [route], backend, plan, reference=route == "reference",
                                  memo=call.cached("qsa.tokens", dict)).outputs[route]
    return run


# -- PyTorch SDPA and FlexAttention over whole pages ----------------------------------------------

SDPA_BACKENDS = {"math": "MATH", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "flash": "FLASH_ATTENTION"}


def _dense_inputs(call: PagedCall):
    """q [rows, Hq, 1, D]; K, V [rows, Hq, S, D] (the one KV head repeated); mask [rows, 1, 1, S]."""
    rows, hq, d = call.q.shape
    # materialised per head: some fused backends refuse a zero head stride
    k = call.pages(0).unsqueeze(1).expand(rows, hq, -1, d).contiguous()
    v = call.pages(1).unsqueeze(1).expand(rows, hq, -1, d).contiguous()
    return call.q.unsqueeze(2), k, v, call.attend().to(call.device).view(rows, 1, 1, -1)


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

    case, dev = call.case, call.device
    rows = call.q.shape[0]
    pages, ps = case.kv_cache.shape[0], case.geometry.page_size
    attend = call.attend()                                                  # [rows, max_pages * ps] logical
    paged = PagedAttention(pages, ps, rows, device=dev)
    table = case.block_table.long()[case.token_to_req.long()]              # [rows, max_pages]
    used = torch.arange(table.shape[1]) < -(-case.seq_lens.long()[case.token_to_req.long()] // ps).unsqueeze(1)
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
    case, dev = call.case, call.device
    rows, hq, d = call.q.shape
    pages, ps = case.kv_cache.shape[0], case.geometry.page_size
    block_mask = call.cached("flex-paged.block_mask", lambda: _paged_block_mask(call))
    kv = [case.decoded_plane(p).to(torch.float16).reshape(1, 1, pages * ps, d).expand(rows, hq, -1, d)
          .contiguous().to(dev) for p in (0, 1)]
    run = functools.partial(_flex_fn(dev.type), call.q.unsqueeze(2), kv[0], kv[1], block_mask=block_mask,
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


def builtin_kernels() -> tuple:
    from ..routes import ROUTES

    return tuple(f"qsa:{r}" for r in ROUTES) + tuple(TORCH_KERNELS)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def load_user_kernel(spec: str) -> Callable:
    """'package.module:function' or 'path/to/file.py:function' -> the callable."""
    mod_name, _, fn_name = spec.rpartition(":")
    if not mod_name or not fn_name:
        raise ValueError(f"kernels: {spec!r} is not a known kernel nor module:function")
    try:
        if mod_name.endswith(".py"):
            path = Path(mod_name)
            if not path.is_file():
                raise ValueError(f"kernels: {spec!r}: no file {path}")
            mspec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(mspec)
            mspec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"kernels: {spec!r}: cannot import {mod_name!r} ({_first_line(e)})") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"kernels: {spec!r}: {mod_name} has no callable {fn_name!r}")
    return fn


def kernel_name(kernel) -> str:
    if isinstance(kernel, str):
        return kernel
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
    return load_user_kernel(kernel)
