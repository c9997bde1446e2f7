"""Run the compute_70 PTX of ``csrc/`` on a newer GPU, through the CUDA driver.

The NVRTC check (``nvrtc_sm70.py``) proves that the device headers *compile* for a V100;
this module proves the same code *runs*: the driver of any newer GPU JIT-compiles
compute_70 PTX, so loading it executes exactly the instructions a V100 build uses
(no sm_80+ features), with the V100 shared-memory opt-in and the binding's launch
configuration.

Two halves, two machines:

- ``generate(out, root)`` (no GPU; needs the ``nvrtc`` dependency group): compile every entry
  point of ``root/csrc`` for compute_70 with NVRTC, ask NVRTC for each one's mangled
  name (name expressions, never spelled by hand), and write the PTX plus a manifest
  (csrc hashes, NVRTC version, lowered names, parameter sizes, launch constants).
- ``Ptx70(folder)`` and its ``grouped_forward`` / ``xqa_forward`` (GPU; only the driver
  library, libcuda, through ctypes): load that PTX with ``cuModuleLoadDataEx`` in torch's
  context and launch it with torch tensors' pointers on torch's current stream, exactly
  as ``csrc/bindings.cu`` launches the extension. The signatures are those of
  ``qsa_lab.routes.compiled``, so the same comparison code runs all three.

Nothing about the kernels' arguments is assumed: ``GroupedParams`` / ``XqaParams`` are
read from the header into ``ctypes`` structures, whose size must equal the PTX's
``.param .align A .b8 <entry>_param_0[SIZE]``, and whose field names must equal the
fields ``bindings.cu`` assigns; any difference refuses to run instead of passing a
misread struct to a kernel. ``tools/ptx70_check.py`` drives both halves. Developer tooling: it
works on a checkout and is not part of the wheel.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import nvrtc_sm70   # beside this file: tools/ is on sys.path (python tools/ptx70_check.py, pytest's pythonpath)
from qsa_lab.support.machine import find_nvrtc

#: the checkout this tooling sits in and works on by default
ROOT = Path(__file__).resolve().parents[1]
ARCH = "compute_70"
PTX_FILE = "qsa_lab_compute70.ptx"
MANIFEST_FILE = "manifest.json"
SCHEMA = "qsa_lab.ptx70/1"
V100_MAX_SMEM_OPTIN = 96 * 1024  # cudaDevAttrMaxSharedMemoryPerBlockOptin of a V100
DEFAULT_SMEM_LIMIT = 48 * 1024   # above this a kernel must opt in (every arch)

PROBE = "qsa_ptx70_smem_probe"
CONSTANTS = "qsa_ptx70_constants"
SMEM_TABLE = "qsa_ptx70_grouped_smem"
Q_HEADS = range(1, 9)           # every geometry the kernels take (qsa_lab.routes.compiled limits)
HEAD_DIMS = range(16, 257, 16)


class StaleError(RuntimeError):
    """The PTX folder, the headers and this module's mirror of the binding disagree."""


# ---------------------------------------------------------------- entry points

def nvrtc_module(root: Path = ROOT):
    """`root`'s own tools/nvrtc_sm70.py (FORMATS, VARIANTS, instantiation_source),
    loaded by path so that a PTX for another checkout uses that checkout's lists."""
    path = Path(root) / "tools" / "nvrtc_sm70.py"
    if not path.is_file():
        raise ValueError(f"root: {root} holds no tools/nvrtc_sm70.py (not a qsa_lab checkout)")
    if path.resolve() == Path(nvrtc_sm70.__file__).resolve():
        return nvrtc_sm70
    name = f"_qsa_lab_nvrtc_{sha256(str(path.resolve()).encode())[:12]}"
    if name not in sys.modules:  # dataclasses look their module up in sys.modules
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def _enum_name(cpp: str) -> str:
    """'qsa::kKernelFixNoLeadingBarrier' -> 'KernelFixNoLeadingBarrier'."""
    m = re.fullmatch(r"qsa::k(\w+)", cpp)
    if not m:
        raise ValueError(f"expected an enumerator 'qsa::kName', got {cpp!r}")
    return m.group(1)


def format_key(cpp: str) -> str:
    """'qsa::kE4M3' -> 'e4m3' (the kv_dtype names of qsa_lab.routes.compiled)."""
    return _enum_name(cpp).lower()


def variant_key(cpp: str) -> str:
    """'qsa::kMaskedLoad' -> 'masked_load' (the variant names of qsa_lab.routes.compiled)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", _enum_name(cpp)).lower()


@dataclass(frozen=True)
class EntryPoint:
    kind: str                  # "grouped" | "xqa_partition" | "xqa_reduce" | "probe"
    expression: str            # C++ name expression handed to NVRTC
    fmt: str | None = None     # kv_dtype name ("e4m3") or None
    variant: str | None = None  # variant name ("kernel_fix") or None
    params: str | None = None  # parameter struct, or None (the probe takes scalars)

    @property
    def label(self) -> str:
        args = ",".join(a for a in (self.fmt, self.variant) if a)
        short = {"grouped": "grouped_page4_forward", "xqa_partition": "xqa_partition_kernel",
                 "xqa_reduce": "xqa_reduce_kernel", "probe": PROBE}[self.kind]
        return f"{short}<{args}>" if args else short


def entry_points(formats, variants, reduce_per_format: bool = False) -> list[EntryPoint]:
    """Every kernel the binding launches, for every FORMAT x VARIANT, plus the probe."""
    eps = [] if reduce_per_format else [EntryPoint("xqa_reduce", "qsa::xqa_reduce_kernel", params="XqaParams")]
    for fmt in formats:
        eps.append(EntryPoint("xqa_partition", f"qsa::xqa_partition_kernel<{fmt}>", format_key(fmt),
                              params="XqaParams"))
        if reduce_per_format:
            eps.append(EntryPoint("xqa_reduce", f"qsa::xqa_reduce_kernel<{fmt}>", format_key(fmt), params="XqaParams"))
        for var in variants:
            eps.append(EntryPoint("grouped", f"qsa::grouped_page4_forward<{fmt}, {var}>", format_key(fmt),
                                  variant_key(var), params="GroupedParams"))
    eps.append(EntryPoint("probe", PROBE))
    return eps


def header_features(headers: str) -> dict:
    """How the headers split XQA (the binding follows them): a per-format reduce kernel,
    per-format partition sizes and partial dtypes, and xqa_smem_bytes' arguments."""
    text = strip_comments(headers)
    return {
        "reduce_per_format": bool(re.search(r"template\s*<\s*int\s+\w+\s*>\s*__global__[^;{]*?\bxqa_reduce_kernel\s*\(",
                                            text)),
        "partition_per_format": bool(re.search(r"\bpartition_tokens\s*\(\s*int\b", text)),
        "partial_bytes": bool(re.search(r"\bpartial_bytes\s*\(\s*int\b", text)),
        "xqa_smem_takes_format": bool(re.search(r"\bxqa_smem_bytes\s*\(\s*int\s+\w+\s*,\s*int\s+\w+\s*,\s*int\b", text)),
        "smem_layout_constexpr": bool(re.search(r"\bconstexpr\s+SmemLayout\s+smem_layout\s*\(", text)),
    }


def probe_source(formats, features: dict) -> str:
    """Appended to nvrtc.instantiation_source(): the headers' own launch constants as an
    array (read back from the PTX initializer), and a kernel that evaluates the headers'
    own shared-memory functions on the GPU, so the Python replicas are checked against
    the code the binding calls. Constants: grouped threads, XQA threads, then per format
    the XQA partition tokens, then per format the partial bytes."""
    part = (lambda f: f"qsa::xqa::partition_tokens({f})") if features["partition_per_format"] \
        else (lambda f: "qsa::xqa::kPartition")
    pbytes = (lambda f: f"qsa::xqa::partial_bytes({f})") if features["partial_bytes"] else (lambda f: "4")
    values = ["qsa::grouped::kThreads", "qsa::xqa::kThreads"] + [part(f) for f in formats] + [pbytes(f) for f in formats]
    xqa = "".join(
        f"  xqa[i * {len(formats)} + {k}] = qsa::xqa_smem_bytes(q_heads[i], head_dims[i]"
        f"{', ' + f if features['xqa_smem_takes_format'] else ''});\n" for k, f in enumerate(formats))
    # A constexpr smem_layout is evaluated by NVRTC itself for every geometry (read back on the CPU).
    table = "" if not features.get("smem_layout_constexpr") else (
        f'extern "C" __device__ const unsigned int {SMEM_TABLE}[{len(Q_HEADS) * len(HEAD_DIMS)}] = {{'
        + ", ".join(f"qsa::grouped::smem_layout({h}, {d}).total" for h in Q_HEADS for d in HEAD_DIMS) + "};")
    return f"""
{table}
extern "C" __device__ const int {CONSTANTS}[{len(values)}] = {{{", ".join(values)}}};
extern "C" __global__ void {PROBE}(int n, const int* q_heads, const int* head_dims,
                                   unsigned int* grouped, unsigned int* xqa) {{
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  grouped[i] = qsa::grouped::smem_layout(q_heads[i], head_dims[i]).total;
{xqa}}}
"""


# ---------------------------------------------------------------- NVRTC with name expressions

@dataclass
class Compiled:
    ptx: str
    log: str
    lowered: dict     # expression -> mangled name
    version: str      # NVRTC major.minor
    options: list


def compile_entry_points(source: str, expressions, include_dir: Path, toolkit, arch: str = ARCH) -> Compiled:
    """NVRTC `source` for `arch`, returning each name expression's lowered (mangled) name."""
    res = nvrtc_sm70.compile_ptx(source, arch, toolkit, name_expressions=tuple(expressions),
                                 include_dir=include_dir, program="qsa_lab_ptx70.cu")
    if not res.ok:
        raise RuntimeError(f"NVRTC {arch} failed:\n{res.log}")
    return Compiled(res.ptx, res.log, res.lowered, res.version, res.options)


# ---------------------------------------------------------------- reading the PTX

_ENTRY_START = re.compile(r"^(?:\.visible\s+|\.weak\s+)?\.entry\s+(\S+?)\s*\(", re.M)
# What can follow an entry's body: the next entry or function, its .globl note, or the
# line-info trailer (-lineinfo: .file table and .debug_str, which every entry refers to).
_NEXT_TOPLEVEL = re.compile(r"^(?:\s*// \.globl|(?:\.visible\s+|\.weak\s+|\.extern\s+)?\.(?:entry|func)\b|\s*\.file\s)",
                            re.M)
_TRAILER = re.compile(r"^\s*\.file\s", re.M)


def entry_span(ptx: str, lowered: str) -> tuple[int, int]:
    """(start, end) of entry `lowered` in `ptx`: from `.entry` to the next top-level item."""
    starts = [m for m in _ENTRY_START.finditer(ptx) if m.group(1) == lowered]
    if len(starts) != 1:
        raise StaleError(f"entry {lowered} appears {len(starts)} times in the PTX (expected once)")
    start = starts[0].start()
    nxt = _NEXT_TOPLEVEL.search(ptx, starts[0].end())
    return start, nxt.start() if nxt else len(ptx)


@dataclass(frozen=True)
class ParamInfo:
    size: int | None    # bytes of the single struct parameter (None: scalar parameters)
    align: int | None
    count: int          # parameters declared
    maxntid: int | None  # threads per block from __launch_bounds__ (.maxntid x, y, z product)


def entry_params(ptx: str, lowered: str) -> ParamInfo:
    start, end = entry_span(ptx, lowered)
    head = ptx[start:ptx.index("{", start, end)]
    params = re.findall(r"^\s*\.param\s+(.+?)\s*,?\s*$", head, re.M)
    struct = re.fullmatch(r"\.align\s+(\d+)\s+\.b8\s+\S+_param_0\[(\d+)\]", params[0]) if params else None
    ntid = re.search(r"\.maxntid\s+(\d+),\s*(\d+),\s*(\d+)", head)
    maxntid = int(ntid.group(1)) * int(ntid.group(2)) * int(ntid.group(3)) if ntid else None
    return ParamInfo(int(struct.group(2)) if struct else None, int(struct.group(1)) if struct else None,
                     len(params), maxntid)


def ptx_int_array(ptx: str, name: str) -> list[int]:
    """The initializer of the 32-bit array `name` in `ptx` (written as words or as bytes)."""
    m = re.search(rf"\.global\s+\.align\s+\d+\s+\.(?:u32|b32|s32)\s+{name}\[(\d+)\]\s*=\s*\{{([^}}]*)\}}", ptx)
    if m:
        return [int(v) for v in m.group(2).split(",")]
    m = re.search(rf"\.global\s+\.align\s+\d+\s+\.b8\s+{name}\[(\d+)\]\s*=\s*\{{([^}}]*)\}}", ptx)
    if not m:
        raise StaleError(f"{name} not found in the PTX")
    raw = bytes(int(v) for v in m.group(2).split(","))
    raw += bytes(int(m.group(1)) - len(raw))  # trailing zero bytes are left out of the initializer
    return [int.from_bytes(raw[i:i + 4], "little", signed=True) for i in range(0, len(raw), 4)]


def ptx_constants(ptx: str, formats) -> dict:
    """The launch constants array of probe_source(), read from its PTX initializer."""
    values = ptx_int_array(ptx, CONSTANTS)
    keys = [format_key(f) for f in formats]
    if len(values) != 2 + 2 * len(keys):
        raise StaleError(f"{CONSTANTS}: expected {2 + 2 * len(keys)} values, got {values}")
    return {"grouped_threads": values[0], "xqa_threads": values[1],
            "xqa_partition": dict(zip(keys, values[2:2 + len(keys)])),
            "xqa_partial_bytes": dict(zip(keys, values[2 + len(keys):]))}


# ---------------------------------------------------------------- parameter structs

_CTYPES = {"int": ctypes.c_int, "unsigned int": ctypes.c_uint, "long long": ctypes.c_longlong,
           "unsigned long long": ctypes.c_ulonglong, "float": ctypes.c_float, "double": ctypes.c_double}


def strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))


def parse_struct(header: str, name: str) -> list[tuple[str, str]]:
    """[(field, C type)] of `struct name { ... };` in `header`, in declaration order.

    Takes the plain declarations these structs use (`type a;`, `type a, b;`, `T* p;`);
    anything else (arrays, bit fields, nested types, unknown types) raises StaleError
    rather than being guessed."""
    text = strip_comments(header)
    m = re.search(rf"\bstruct\s+{name}\s*\{{(.*?)\}}\s*;", text, re.S)
    if not m:
        raise StaleError(f"struct {name} not found")
    fields = []
    for decl in (d.strip() for d in m.group(1).split(";")):
        if not decl:
            continue
        dm = re.fullmatch(r"((?:const\s+)?[A-Za-z_][\w\s]*?)\s*(\*?)\s*([A-Za-z_]\w*)((?:\s*,\s*\*?\s*[A-Za-z_]\w*)*)", decl)
        if not dm:
            raise StaleError(f"struct {name}: cannot read the declaration {decl!r}")
        base = " ".join(dm.group(1).replace("const", " ").split())
        names = [(dm.group(2), dm.group(3))] + re.findall(r",\s*(\*?)\s*([A-Za-z_]\w*)", dm.group(4))
        for star, field in names:
            if star:
                fields.append((field, base + "*"))
            elif base in _CTYPES:
                fields.append((field, base))
            else:
                raise StaleError(f"struct {name}: field {field} has a type this mirror does not know: {base!r}")
    return fields


def struct_class(name: str, fields) -> type:
    """A ctypes.Structure with `fields` ([(field, C type)]); pointers become c_void_p."""
    return type(name, (ctypes.Structure,), {
        "_fields_": [(f, ctypes.c_void_p if t.endswith("*") else _CTYPES[t]) for f, t in fields]})


def fill(cls: type, values: dict):
    """An instance of `cls` with every field set from `values`: a field the header has and
    the mirror does not fill (or the reverse) is a stale mirror, not a zero."""
    names = [f for f, _ in cls._fields_]
    missing, extra = sorted(set(names) - set(values)), sorted(set(values) - set(names))
    if missing or extra:
        raise StaleError(f"{cls.__name__}: the header's fields and the launch mirror differ "
                         f"(header only: {missing}, mirror only: {extra}); update tools/ptx70.py")
    return cls(**{k: values[k] for k in names})


# ---------------------------------------------------------------- the binding, mirrored

# The launches of csrc/bindings.cu this module reproduces, whitespace-normalised; if the
# binding launches differently, the mirror is stale and check_bindings_mirror says so.
# Each item: the forms the mirror follows (one partition for every format, or one per format).
BINDING_LAUNCHES = (
    ("smem_layout(q_heads, head_dim).total",),
    ("cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem)",),
    ("kernel<<<groups, qsa::grouped::kThreads, smem, stream>>>(p)",),
    ("qsa::xqa_smem_bytes(p.q_heads, p.head_dim)", "qsa::xqa_smem_bytes(p.q_heads, p.head_dim, FMT)"),
    ("kernel<<<dim3(p.parts, n), qsa::xqa::kThreads, smem, stream>>>(p)",),
    ("qsa::xqa_reduce_kernel<<<n, qsa::xqa::kThreads, 0, stream>>>(p)",
     "qsa::xqa_reduce_kernel<FMT><<<n, qsa::xqa::kThreads, 0, stream>>>(p)"),
    ("(T + qsa::xqa::kPartition - 1) / qsa::xqa::kPartition",
     "partition = qsa::xqa::partition_tokens((int)kv_dtype); const int parts = (int)((T + partition - 1) / partition)"),
    ("at::empty({n, parts, q_heads, head_dim}",),
    ("at::empty({2, n, parts, q_heads}",),
)
GROUPED_FIELDS = ("q", "kv", "group_rows", "microblocks", "masks", "seq_len", "out", "lse", "q_heads", "head_dim",
                  "page_size", "cap", "q_rows", "n_microblocks", "qk_scale", "v_scale")
XQA_FIELDS = ("q", "kv", "token_index", "token_count", "part_o", "part_m", "part_l", "out", "q_heads", "head_dim",
              "page_size", "T", "parts", "n_tokens", "qk_scale", "v_scale")


def check_bindings_mirror(bindings: str) -> list[str]:
    """What in `bindings` (csrc/bindings.cu) this module's launch mirror does not match."""
    flat = " ".join(bindings.split())
    problems = [f"launch no longer in bindings.cu: {forms[-1]}" for forms in BINDING_LAUNCHES
                if not any(" ".join(f.split()) in flat for f in forms)]
    for fn, fields in (("grouped_forward", GROUPED_FIELDS), ("xqa_forward", XQA_FIELDS)):
        m = re.search(rf"\b{fn}\s*\(.*?\n\}}", bindings, re.S)
        assigned = set(re.findall(r"^\s*p\.(\w+)\s*=", m.group(0), re.M)) if m else set()
        if assigned != set(fields):
            problems.append(f"{fn}: bindings.cu sets {sorted(assigned)}, the mirror sets {sorted(fields)}")
    return problems


_C_ARITH = re.compile(r"[\w\s+\-*/%()&|~^<>]+")


def _c_int(expr: str) -> str:
    """A C integer expression as Python: casts and `u` suffixes dropped, `/` as floor
    division (the layout's operands are non-negative), `L.x` as the name `L_x`."""
    expr = re.sub(r"\(\s*(?:const\s+)?(?:unsigned\s+int|unsigned|int)\s*\)", "", expr)
    expr = re.sub(r"\b(\d+)[uU]\b", r"\1", expr).replace("/", "//").replace("L.", "L_")
    if not _C_ARITH.fullmatch(expr):
        raise StaleError(f"not plain integer arithmetic: {expr!r}")
    return expr


def grouped_smem_formula(header: str):
    """qsa::grouped::smem_layout(q_heads, head_dim).total as a Python function, read from
    the header that defines it: its `constexpr int` constants, then the function's
    statements (`L.x = off; off = align128(off + ...)`) evaluated in order. The GPU run
    checks the result against the compiled function (the probe kernel) everywhere."""
    text = strip_comments(header)
    m = re.search(r"SmemLayout\s+smem_layout\s*\(\s*int\s+(\w+)\s*,\s*int\s+(\w+)\s*\)\s*\{(.*?)\n\}", text, re.S)
    if not m:
        raise StaleError("smem_layout(int, int) not found in the grouped header")
    consts = {}
    for name, expr in re.findall(r"\bconstexpr\s+int\s+(\w+)\s*=\s*([^;]+);", text[:m.start()]):
        try:
            consts[name] = int(eval(_c_int(expr), {"__builtins__": {}}, dict(consts)))
        except Exception:  # template-dependent or not arithmetic: the layout does not use it
            pass
    program = []
    for stmt in (st.strip() for st in m.group(3).split(";")):
        if not stmt or re.fullmatch(r"SmemLayout\s+L\s*(?:\{\s*\})?|return\s+L", stmt):
            continue
        sm = re.fullmatch(r"(?:const\s+)?(?:unsigned\s+int\s+|int\s+)?(L\.\w+|\w+)\s*=\s*(.+)", stmt, re.S)
        if not sm:
            raise StaleError(f"smem_layout: cannot read the statement {stmt!r}")
        program.append((sm.group(1).replace("L.", "L_"), _c_int(sm.group(2))))
    q_arg, d_arg = m.group(1), m.group(2)

    def total(q_heads: int, head_dim: int) -> int:
        ns = {**consts, q_arg: q_heads, d_arg: head_dim, "align128": lambda x: (x + 127) & ~127}
        for target, expr in program:
            ns[target] = eval(expr, {"__builtins__": {}}, ns)
        return int(ns["L_total"])
    return total


def xqa_smem_bytes(q_heads: int, head_dim: int, partition: int) -> int:
    """qsa::xqa_smem_bytes: token offsets [P] int64 | q [heads][D] f32 | p [heads][P] f32,
    replicated (the probe checks it on the GPU)."""
    return q_heads * head_dim * 4 + q_heads * partition * 4 + partition * 8


# ---------------------------------------------------------------- broken PTX (the check must catch it)

@dataclass(frozen=True)
class Mutation:
    name: str
    fmt: str       # nvrtc FORMATS entry of the entry point to break
    variant: str   # nvrtc VARIANTS entry (grouped kernels)
    old: int       # a 32-bit constant of that entry's PTX ...
    new: int       # ... replaced by this one
    why: str


MUTATIONS = (
    Mutation("mask", "qsa::kE4M3", "qsa::kKernelFix", 0x11111111, 0x11111110,
             "kernel_fix's unattended-row mask drops query 0: rows only query 0 attends are zeroed"),
    Mutation("nan", "qsa::kE4M3", "qsa::kUnfixed", 0x7E007E00, 0x3C003C00,
             "the E4M3 decoder turns NaN codes into 1.0 instead of the route's NaN 0x7E00"),
)


def mutate(ptx: str, lowered: str, old: int, new: int) -> tuple[str, int]:
    """`ptx` with every immediate `old` inside entry `lowered` replaced by `new`; the count."""
    start, end = entry_span(ptx, lowered)
    body, n = re.subn(rf"(?<![\w.]){old}(?![\w.])", str(new), ptx[start:end])
    return ptx[:start] + body + ptx[end:], n


def single_entry_module(ptx: str, lowered: str) -> str:
    """Everything before the first entry (version, target, globals, the extern shared
    array), entry `lowered` and the line-info trailer: a module of one kernel, much
    quicker to JIT."""
    start, end = entry_span(ptx, lowered)
    trailer = _TRAILER.search(ptx)
    return ptx[:_ENTRY_START.search(ptx).start()] + ptx[start:end] + (ptx[trailer.start():] if trailer else "")


# ---------------------------------------------------------------- generate (CPU)

def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def csrc_hashes(csrc: Path) -> dict:
    return {p.name: sha256(p.read_bytes()) for p in sorted(Path(csrc).iterdir()) if p.is_file()}


def header_text(csrc: Path, nv) -> str:
    return "\n".join((Path(csrc) / h).read_text() for h in nv.DEVICE_HEADERS)


def grouped_header(csrc: Path, nv) -> str:
    """The device header that defines smem_layout (its constants come before it)."""
    for h in nv.DEVICE_HEADERS:
        text = (Path(csrc) / h).read_text()
        if re.search(r"SmemLayout\s+smem_layout\s*\(", text):
            return text
    raise StaleError("no device header defines smem_layout")


def smem_tables(csrc: Path, nv, constants: dict) -> dict:
    """Dynamic shared memory of every geometry the kernels take, from the headers' formulas:
    grouped "q_heads,head_dim" -> bytes; xqa "q_heads,head_dim,fmt" -> bytes."""
    grouped = grouped_smem_formula(grouped_header(csrc, nv))
    return {
        "grouped": {f"{h},{d}": grouped(h, d) for h in Q_HEADS for d in HEAD_DIMS},
        "xqa": {f"{h},{d},{f}": xqa_smem_bytes(h, d, p) for h in Q_HEADS for d in HEAD_DIMS
                for f, p in constants["xqa_partition"].items()},
    }


def expected_entry_points(csrc: Path, nv) -> list[EntryPoint]:
    return entry_points(nv.FORMATS, nv.VARIANTS, header_features(header_text(csrc, nv))["reduce_per_format"])


def mirror_structs(header: str, ptx: str, eps, lowered: dict) -> dict:
    """Parse the parameter structs and check each against every PTX entry that takes it."""
    structs = {}
    for name in sorted({e.params for e in eps if e.params}):
        fields = parse_struct(header, name)
        cls = struct_class(name, fields)
        for e in eps:
            if e.params != name:
                continue
            info = entry_params(ptx, lowered[e.expression])
            if info.count != 1 or info.size != ctypes.sizeof(cls) or info.align != ctypes.alignment(cls):
                raise StaleError(f"{e.label}: the PTX takes {info.count} parameter(s), .align {info.align} "
                                 f"[{info.size}] bytes; the ctypes mirror of {name} is .align "
                                 f"{ctypes.alignment(cls)} [{ctypes.sizeof(cls)}]")
        structs[name] = {"size": ctypes.sizeof(cls), "align": ctypes.alignment(cls), "fields": fields}
    return structs


def generate(out: Path, root: Path = ROOT, toolkit=None, force: bool = False) -> dict:
    """Compile every entry point of root/csrc for compute_70; write PTX + manifest to `out`."""
    root, out = Path(root), Path(out)
    nv = nvrtc_module(root)
    toolkit = toolkit or find_nvrtc()
    if toolkit is None:
        raise RuntimeError("NVRTC wheels missing: pip install --group nvrtc")
    files = [out / PTX_FILE, out / MANIFEST_FILE]
    if not force and any(f.exists() for f in files):
        raise FileExistsError(f"out: {out} already holds a PTX or manifest (pass force=True / --force to replace)")
    csrc = root / "csrc"
    problems = check_bindings_mirror((csrc / "bindings.cu").read_text())
    if problems:
        raise StaleError("csrc/bindings.cu changed what this mirror reproduces:\n  " + "\n  ".join(problems))
    features = header_features(header_text(csrc, nv))
    eps = entry_points(nv.FORMATS, nv.VARIANTS, features["reduce_per_format"])
    compiled = compile_entry_points(nv.instantiation_source() + probe_source(nv.FORMATS, features),
                                    [e.expression for e in eps], csrc, toolkit)
    forbidden = nv.forbidden_instructions(compiled.ptx)
    if forbidden:
        raise RuntimeError(f"the compute_70 PTX holds instructions an SM70 lacks: {forbidden}")
    structs = mirror_structs(header_text(csrc, nv), compiled.ptx, eps, compiled.lowered)
    entries = []
    for e in eps:
        low = compiled.lowered[e.expression]
        entries.append({**asdict(e), "label": e.label, "lowered": low, **asdict(entry_params(compiled.ptx, low))})
    for mu in MUTATIONS:  # the broken PTX must be possible to make from this one
        low = compiled.lowered[f"qsa::grouped_page4_forward<{mu.fmt}, {mu.variant}>"]
        if mutate(compiled.ptx, low, mu.old, mu.new)[1] == 0:
            raise StaleError(f"mutation {mu.name}: constant {mu.old:#x} is not in {low}; update ptx70.MUTATIONS")
    constants = ptx_constants(compiled.ptx, nv.FORMATS)
    smem = smem_tables(csrc, nv, constants)
    if features["smem_layout_constexpr"]:  # the formula against NVRTC's own evaluation
        compiled_table = ptx_int_array(compiled.ptx, SMEM_TABLE)
        differ = [f"{k}: header {v}, formula {smem['grouped'][k]}"
                  for k, v in zip(smem["grouped"], compiled_table) if v != smem["grouped"][k]]
        if differ:
            raise StaleError("the smem_layout formula read from the header differs from NVRTC's: " + "; ".join(differ[:5]))
    manifest = {
        "schema": SCHEMA, "arch": ARCH, "nvrtc_version": compiled.version, "nvrtc_options": compiled.options[:3],
        "csrc": csrc_hashes(csrc), "formats": list(nv.FORMATS), "variants": list(nv.VARIANTS),
        "ptx": {"file": PTX_FILE, "sha256": sha256(compiled.ptx.encode()), "bytes": len(compiled.ptx)},
        "features": features, "constants": constants, "structs": structs, "entry_points": entries,
        "smem": smem, "nvrtc_log": compiled.log,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / PTX_FILE).write_text(compiled.ptx)
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


# ---------------------------------------------------------------- verify a folder against a checkout

def read_folder(folder: Path, root: Path = ROOT) -> tuple[dict, str]:
    """(manifest, ptx) of `folder`, refused (StaleError) unless it was generated from the
    very csrc/ and nvrtc lists of `root` and the struct mirror still matches its PTX."""
    folder, root = Path(folder), Path(root)
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text())
        ptx = (folder / PTX_FILE).read_text()
    except FileNotFoundError as e:
        raise StaleError(f"{folder}: {e.filename} missing (run the generate step first)") from e
    if manifest.get("schema") != SCHEMA:
        raise StaleError(f"{folder}: manifest schema {manifest.get('schema')!r}, expected {SCHEMA!r}")
    if sha256(ptx.encode()) != manifest["ptx"]["sha256"]:
        raise StaleError(f"{folder}: {PTX_FILE} does not match its manifest's sha256")
    here = csrc_hashes(Path(root) / "csrc")
    differ = sorted(n for n in set(here) | set(manifest["csrc"]) if here.get(n) != manifest["csrc"].get(n))
    if differ:
        raise StaleError(f"stale PTX: csrc/ differs from the one it was generated from ({', '.join(differ)}); "
                         "run the generate step on this checkout")
    nv = nvrtc_module(root)
    if list(nv.FORMATS) != manifest["formats"] or list(nv.VARIANTS) != manifest["variants"]:
        raise StaleError("stale PTX: nvrtc.FORMATS/VARIANTS differ from the ones it was generated for")
    problems = check_bindings_mirror((Path(root) / "csrc" / "bindings.cu").read_text())
    if problems:
        raise StaleError("csrc/bindings.cu changed what this mirror reproduces:\n  " + "\n  ".join(problems))
    eps = expected_entry_points(Path(root) / "csrc", nv)
    lowered = {e["expression"]: e["lowered"] for e in manifest["entry_points"]}
    if sorted(lowered) != sorted(e.expression for e in eps):
        raise StaleError("stale PTX: its entry points differ from the ones the headers declare")
    mirror_structs(header_text(Path(root) / "csrc", nv), ptx, eps, lowered)
    return manifest, ptx


# ---------------------------------------------------------------- the CUDA driver (GPU side)

CU_JIT_INFO_LOG_BUFFER, CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES = 3, 4
CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 5, 6
CU_FUNC_ATTRIBUTE = {"max_threads": 0, "static_smem": 1, "local_bytes": 3, "registers": 4,
                     "ptx_version": 5, "binary_version": 6, "max_dynamic_smem": 8}


class Driver:
    """The few CUDA driver calls this needs, through ctypes on libcuda (no toolkit).

    Works in torch's context: torch creates the device's primary context on first use,
    and the module is loaded into whatever context is current on this thread."""

    def __init__(self):
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA GPU visible: the compute_70 PTX runs only on a GPU")
        torch.zeros(1, device="cuda")  # makes torch's (primary) context current here
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        ctx = ctypes.c_void_p()
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            raise RuntimeError("no current CUDA context after torch initialised the GPU")
        self.modules = []

    def check(self, status: int, what: str) -> None:
        if status != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(status, ctypes.byref(name))
            raise RuntimeError(f"{what}: {name.value.decode() if name.value else status}")

    def load_ptx(self, ptx: str) -> tuple[ctypes.c_void_p, str]:
        """JIT `ptx` for this GPU; (module, JIT info log). A JIT error raises with its log."""
        info, err = ctypes.create_string_buffer(1 << 16), ctypes.create_string_buffer(1 << 16)
        opts = (ctypes.c_int * 4)(CU_JIT_INFO_LOG_BUFFER, CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
                                  CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES)
        vals = (ctypes.c_void_p * 4)(ctypes.cast(info, ctypes.c_void_p), len(info),
                                     ctypes.cast(err, ctypes.c_void_p), len(err))
        module = ctypes.c_void_p()
        status = self.lib.cuModuleLoadDataEx(ctypes.byref(module), ptx.encode() + b"\0", 4, opts, vals)
        if status != 0:
            self.check(status, f"cuModuleLoadDataEx (JIT log: {err.value.decode(errors='replace').strip()})")
        self.modules.append(module)
        return module, info.value.decode(errors="replace").strip()

    def function(self, module, lowered: str) -> ctypes.c_void_p:
        fn = ctypes.c_void_p()
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(fn), module, lowered.encode()),
                   f"cuModuleGetFunction({lowered})")
        return fn

    def attributes(self, fn) -> dict:
        out = {}
        for name, attr in CU_FUNC_ATTRIBUTE.items():
            v = ctypes.c_int()
            self.check(self.lib.cuFuncGetAttribute(ctypes.byref(v), attr, fn), f"cuFuncGetAttribute({name})")
            out[name] = v.value
        return out

    def opt_in_smem(self, fn, smem: int) -> None:
        """The binding's cudaFuncSetAttribute(MaxDynamicSharedMemorySize): V100 needs it above 48 KB."""
        self.check(self.lib.cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE["max_dynamic_smem"], smem),
                   "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")

    def launch(self, fn, grid, threads: int, smem: int, args) -> None:
        """Launch on torch's current stream; `args` are ctypes objects, one per parameter."""
        import torch

        ptrs = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
        grid = tuple(grid) + (1,) * (3 - len(grid))
        stream = torch.cuda.current_stream().cuda_stream
        self.check(self.lib.cuLaunchKernel(fn, *grid, threads, 1, 1, smem, stream, ptrs, None), "cuLaunchKernel")

    def synchronize(self) -> None:
        """Wait for the launched kernels; an error in one raises here."""
        self.check(self.lib.cuCtxSynchronize(), "kernel execution (cuCtxSynchronize)")

    def unload(self) -> None:
        for m in self.modules:
            self.lib.cuModuleUnload(m)
        self.modules = []


# ---------------------------------------------------------------- loaded PTX and its launches

class Ptx70:
    """The compute_70 PTX of a folder, loaded on the GPU, launched like bindings.cu."""

    def __init__(self, folder: Path, root: Path = ROOT, driver: Driver | None = None, only=None, ptx: str | None = None):
        """Load the folder's PTX; with `only` (an entry key) and `ptx` (a mutated copy), just
        that entry of `ptx`, in a module of its own (a much shorter JIT)."""
        self.manifest, self.ptx = read_folder(folder, root)
        self.entries = {(e["kind"], e["fmt"], e["variant"]): e for e in self.manifest["entry_points"]}
        self.structs = {n: struct_class(n, [tuple(f) for f in s["fields"]]) for n, s in self.manifest["structs"].items()}
        self.const = self.manifest["constants"]
        self.smem = self.manifest["smem"]
        self.driver = driver or Driver()
        if only is None:
            self.module, self.jit_log = self.driver.load_ptx(self.ptx)
            keys = list(self.entries)
        else:
            try:
                self.ptx = single_entry_module(ptx, self.entries[only]["lowered"])
                self.module, self.jit_log = self.driver.load_ptx(self.ptx)
            except RuntimeError:  # the entry needs more of the module than its header: JIT all of it
                self.ptx = ptx
                self.module, self.jit_log = self.driver.load_ptx(self.ptx)
            keys = [only]
        self.functions = {k: self.driver.function(self.module, self.entries[k]["lowered"]) for k in keys}

    def check_smem_replicas(self) -> list[str]:
        """Run the probe (the headers' own smem_layout / xqa_smem_bytes, compiled) on the GPU
        over every (q_heads, head_dim) the kernels take: the tables must agree everywhere."""
        import torch

        fmts = [format_key(f) for f in self.manifest["formats"]]
        geo = [(h, d) for h in Q_HEADS for d in HEAD_DIMS]
        hq = torch.tensor([h for h, _ in geo], dtype=torch.int32, device="cuda")
        hd = torch.tensor([d for _, d in geo], dtype=torch.int32, device="cuda")
        grouped = torch.zeros(len(geo), dtype=torch.int32, device="cuda")
        xqa = torch.zeros(len(geo), len(fmts), dtype=torch.int32, device="cuda")
        self.driver.launch(self.functions[("probe", None, None)], (-(-len(geo) // 128),), 128, 0,
                           [ctypes.c_int(len(geo)), ctypes.c_void_p(hq.data_ptr()), ctypes.c_void_p(hd.data_ptr()),
                            ctypes.c_void_p(grouped.data_ptr()), ctypes.c_void_p(xqa.data_ptr())])
        self.driver.synchronize()
        bad = []
        for i, (h, d) in enumerate(geo):
            if int(grouped[i]) != self.smem["grouped"][f"{h},{d}"]:
                bad.append(f"grouped q_heads {h} head_dim {d}: header {int(grouped[i])}, "
                           f"formula {self.smem['grouped'][f'{h},{d}']}")
            for k, f in enumerate(fmts):
                if int(xqa[i, k]) != self.smem["xqa"][f"{h},{d},{f}"]:
                    bad.append(f"xqa {f} q_heads {h} head_dim {d}: header {int(xqa[i, k])}, "
                               f"replica {self.smem['xqa'][f'{h},{d},{f}']}")
        return bad

    def function_info(self, key) -> dict:
        return self.driver.attributes(self.functions[key])

    def grouped_forward(self, q, kv_cache, k_scale, v_scale, group_rows, microblocks, masks, seq_len, *,
                        kv_dtype, sm_scale, variant):
        """As qsa_lab.routes.compiled.grouped_forward, from the PTX. Inputs must already have passed
        the extension's checks (the caller runs the extension first on the same tensors)."""
        import torch

        fn = self.functions[("grouped", kv_dtype, variant)]
        groups, (_, q_heads, head_dim) = group_rows.shape[0], q.shape
        out = torch.empty(groups, 8, q_heads, head_dim, dtype=torch.float16, device=q.device)
        if groups == 0:
            return out
        rows64 = group_rows.to(torch.int64).contiguous()  # the binding's group_rows.to(at::kLong)
        page_size = kv_cache.shape[2]
        p = fill(self.structs["GroupedParams"], dict(
            q=q.data_ptr(), kv=kv_cache.data_ptr(), group_rows=rows64.data_ptr(), microblocks=microblocks.data_ptr(),
            masks=masks.data_ptr(), seq_len=seq_len.data_ptr(), out=out.data_ptr(), lse=None, q_heads=q_heads,
            head_dim=head_dim, page_size=page_size, cap=microblocks.shape[1], q_rows=q.shape[0],
            n_microblocks=kv_cache.shape[0] * (page_size // 4), qk_scale=float(sm_scale) * float(k_scale),
            v_scale=float(v_scale)))
        smem = self.smem["grouped"][f"{q_heads},{head_dim}"]
        self.driver.opt_in_smem(fn, smem)  # the binding opts in on every launch; a V100 needs it above 48 KB
        self.driver.launch(fn, (groups,), self.const["grouped_threads"], smem, [p])
        self.driver.synchronize()  # rows64 lives until the kernel is done; errors surface here
        return out

    def xqa_forward(self, q_rows, kv_cache, k_scale, v_scale, token_index, token_count, *, kv_dtype, sm_scale):
        """As qsa_lab.routes.compiled.xqa_forward, from the PTX (partition kernel, then reduce)."""
        import torch

        n, q_heads, head_dim = q_rows.shape
        out = torch.empty_like(q_rows)
        if n == 0:
            return out
        T, part = token_index.shape[1], self.const["xqa_partition"][kv_dtype]
        parts = -(-T // part)
        partial = {4: torch.float32, 2: torch.float16}[self.const["xqa_partial_bytes"][kv_dtype]]
        part_o = torch.empty(n, parts, q_heads, head_dim, dtype=partial, device=q_rows.device)
        part_ml = torch.empty(2, n, parts, q_heads, dtype=torch.float32, device=q_rows.device)
        page_size = kv_cache.shape[2]
        p = fill(self.structs["XqaParams"], dict(
            q=q_rows.data_ptr(), kv=kv_cache.data_ptr(), token_index=token_index.data_ptr(),
            token_count=token_count.data_ptr(), part_o=part_o.data_ptr(), part_m=part_ml[0].data_ptr(),
            part_l=part_ml[1].data_ptr(), out=out.data_ptr(), q_heads=q_heads, head_dim=head_dim,
            page_size=page_size, T=T, parts=parts, n_tokens=kv_cache.shape[0] * page_size,
            qk_scale=float(sm_scale) * float(k_scale), v_scale=float(v_scale)))
        smem = self.smem["xqa"][f"{q_heads},{head_dim},{kv_dtype}"]
        fn = self.functions[("xqa_partition", kv_dtype, None)]
        reduce = self.functions.get(("xqa_reduce", kv_dtype, None)) or self.functions[("xqa_reduce", None, None)]
        self.driver.opt_in_smem(fn, smem)
        self.driver.launch(fn, (parts, n), self.const["xqa_threads"], smem, [p])
        self.driver.launch(reduce, (n,), self.const["xqa_threads"], 0, [p])
        self.driver.synchronize()
        return out
