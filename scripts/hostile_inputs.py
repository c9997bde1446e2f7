"""Throw a few hundred hostile inputs at qsa_lab and classify what happens to each.

    python scripts/hostile_inputs.py                    # the qsa_lab on sys.path
    cd /tmp && PYTHONPATH=/path/to/other/checkout python /path/to/hostile_inputs.py

Surfaces: the CLI (`qsa_lab.app.cli.main`, in-process), the Python API (case building, poison,
routes, analysis, canary, export, the playground widget and the notebooks' backend switch),
loading saved files (corrupt, torn, contradicting their metadata), and issue 40's ("iv"): replay in
a received folder, other-requests at any request count, the canary at real models' geometries and
its memory budget, the scribble's bad input and nothing-checked runs, signals, killed reports.
Each probe runs in a forked child with a time limit and a cap on its address space, so a
hang or a memory bomb costs seconds, not the machine. Outcomes:

    clear error      exit 2 with one line naming the argument / ValueError or TypeError naming it
    vague error      refused, but without naming the argument, on several lines or with the wrong exit code
    traceback        an uncaught exception (CLI) or one that is not ValueError/TypeError (API)
    hang             still running after the time limit
    silent wrong     accepted an input that should have been refused (or a result that differs run to run)
    overwritten      a file the user made was replaced or written through
    ok               a valid input accepted (the probe expected success)

Not run by the test suite (it takes minutes); the tests hold a small version of each class.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import io as _io
import json
import multiprocessing as mp
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

torch.set_num_threads(1)

import qsa_lab  # noqa: E402
from qsa_lab.app import case_file as qio  # noqa: E402
from qsa_lab.model.case import Geometry, build_case  # noqa: E402
from qsa_lab.app.cli import main  # noqa: E402
from qsa_lab.model.poison import apply_poison  # noqa: E402
from qsa_lab.routes.run import run_routes  # noqa: E402

TIMEOUT_S = 30  # per probe, generous: the machine may be loaded (--timeout)
EXTRA_ADDRESS_SPACE = 3 << 30
TINY = ["--rows", "8", "--context", "64", "--topk", "8", "--head-dim", "16", "--backend", "emulate"]
TINY_G = Geometry(rows=8, context=64, topk=8, head_dim=16)
CLASSES = ["clear error", "vague error", "traceback", "hang", "silent wrong", "overwritten", "ok"]


class Probe:
    def __init__(self, surface, name, fn, needle=None, expect_ok=False, user_file=None, is_cli=None):
        self.surface, self.name, self.fn, self.needle = surface, name, fn, needle
        self.is_cli = surface in ("cli", "load") if is_cli is None else is_cli
        self.expect_ok, self.user_file = expect_ok, user_file


def _child(probe, conn):
    soft = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024 + EXTRA_ADDRESS_SPACE
    resource.setrlimit(resource.RLIMIT_AS, (soft, soft))
    out, err = _io.StringIO(), _io.StringIO()
    res = {}
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            res = probe.fn() or {}
    except BaseException as e:  # noqa: BLE001 - every outcome is data here
        res = {"exc": type(e).__name__, "msg": str(e)[:300],
               "named_kind": isinstance(e, (ValueError, TypeError, FileNotFoundError, FileExistsError))}
    res["stderr"] = err.getvalue()[-2000:]
    conn.send(res)
    conn.close()


def run_probe(probe) -> tuple[str, dict]:
    ctx = mp.get_context("fork")
    a, b = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(probe, b))
    t0 = time.time()
    p.start()
    res = a.recv() if a.poll(TIMEOUT_S) else None
    p.join(1)
    if p.is_alive():
        p.kill()
        p.join()
    if res is None:
        return "hang", {"seconds": time.time() - t0}
    return classify(probe, res), res


def classify(probe, res) -> str:
    if probe.user_file is not None:
        path, content = probe.user_file
        try:
            same = Path(path).read_bytes() == content
        except OSError:
            same = False
        if not same:
            return "overwritten"
    if probe.is_cli:
        if "exc" in res:
            return "traceback"           # escaped main(): a traceback on the terminal
        code, err = res["code"], res["stderr"]
        if "Traceback" in err:
            return "traceback"
        if "replay differs" in probe.name and code in (0, 1):
            return "ok" if code == 1 else "silent wrong"
        if code == 0:
            return "ok" if probe.expect_ok else "silent wrong"
        lines = err.strip().splitlines()
        named = probe.needle is None or any(n in err for n in probe.needle.split("|"))
        if probe.expect_ok:
            return "vague error"
        return "clear error" if code == 2 and len(lines) == 1 and named else "vague error"
    # API
    if "exc" in res:
        if not res["named_kind"]:
            return "traceback"
        named = probe.needle is None or any(n in res["msg"] for n in probe.needle.split("|"))
        return "vague error" if probe.expect_ok or not named else "clear error"
    if res.get("differs"):
        return "silent wrong"
    return "ok" if probe.expect_ok else "silent wrong"


# ---------------------------------------------------------------- probes

def cli(argv, needle, **kw):
    def fn():
        return {"code": main(list(argv))}
    shown = ["diff", "<tiny>", *argv[1 + len(TINY):]] if argv[1:1 + len(TINY)] == TINY else argv
    return Probe("cli", " ".join(map(repr, shown))[:160], fn, needle, **kw)


def api(name, fn, needle, **kw):
    return Probe("api", name, fn, needle, **kw)


def saved_case(folder: Path) -> Path:
    path = folder / "good.safetensors"
    res = run_routes(apply_poison(build_case(TINY_G), "targeted", dims=[3]), backend="emulate")
    try:
        qio.save(res, path)
    except TypeError:
        qio.save(res, str(path))
    return path


def rewrite(src: Path, dst: Path, drop=(), add=None, meta=None) -> Path:
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys() if k not in drop}
        m = dict(f.metadata())
    t.update(add or {})
    m.update(meta or {})
    save_file(t, str(dst), metadata={k: v for k, v in m.items() if v is not None})
    return dst


def cli_probes(d: Path) -> list[Probe]:
    P = []
    ints = {"--rows": "rows", "--requests": "requests", "--context": "context", "--topk": "topk",
            "--page-size": "page", "--q-heads": "q_heads|q-heads", "--head-dim": "head", "--seed": "seed",
            "--poison-seed": "seed"}
    for flag, api_name in ints.items():
        needle = f"{flag}|{api_name}"
        bad = ["-1", "x", "1.5", "", "99999999999999999999999", "0x10", " "]
        if flag not in ("--seed", "--poison-seed"):
            bad += ["0"]
        if flag in ("--rows", "--context", "--topk", "--page-size", "--head-dim", "--requests"):
            bad += ["1000000000", "268435456"]  # memory bombs
        if flag in ("--page-size", "--head-dim"):
            bad += ["3", "17"]
        if flag in ("--seed", "--poison-seed"):
            bad += [str(2 ** 64), str(2 ** 70)]
        for v in bad:
            extra = ["--poison", "random"] if flag == "--poison-seed" else []
            P.append(cli(["diff", *TINY, *extra, flag, v], needle))
    for flag, v in [("--layout", "spiral"), ("--kv-dtype", "int4"), ("--group-rows", "x"), ("--poison", "all"),
                    ("--plane", "q"), ("--backend", "tpu"), ("--layout", ""), ("--kv-dtype", "E4M3")]:
        P.append(cli(["diff", *TINY, flag, v], flag))
    for v in ["a", "1,,x", "-1", "16", "1.5", "", "99999999999"]:
        P.append(cli(["diff", *TINY, "--poison", "targeted", "--dims", v], "--dims|dims"))
    P.append(cli(["diff", *TINY, "--poison", "zeros", "--dims", "1"], "--dims|dims"))
    P.append(cli(["diff", *TINY, "--poison", "stale-tail"], "stale-tail|--poison"))
    P.append(cli(["diff", *TINY, "--rows", "8", "--requests", "9"], "--rows|rows|--requests"))
    P.append(cli(["diff", *TINY, "--context", "6", "--rows", "8"], "--context|context"))
    P.append(cli(["frobnicate"], "frobnicate"))
    P.append(cli([], "command|cmd"))
    P.append(cli(["diff", *TINY, "--ro", "5"], "--ro"))
    P.append(cli(["diff", *TINY, "--frobnicate"], "--frobnicate"))
    P.append(cli(["diff", "--load", "x.safetensors", "--rows", "3"], "--load"))
    P.append(cli(["diff", "--load", "", *TINY[-2:]], "--load"))
    # memory bombs by combination
    for combo in (["--rows", "65536", "--context", "1048576"], ["--rows", "4096", "--topk", "65536",
                                                                  "--context", "1048576"],
                  ["--requests", "4096", "--rows", "4096", "--context", "1048576"],
                  ["--head-dim", "1024", "--context", "1048576", "--requests", "64", "--rows", "64"]):
        P.append(cli(["diff", "--backend", "emulate", *combo], "--max-memory|--rows|--context|--topk"))
    # output paths, for --json and --save
    for flag in ("--json", "--save"):
        k = flag.strip("-")
        (d / f"fifo_{k}").exists() or os.mkfifo(d / f"fifo_{k}")
        (d / f"dir_{k}").mkdir(exist_ok=True)
        mine = d / f"mine_{k}.txt"
        mine.write_bytes(b"user data")
        link = d / f"link_{k}"
        link.exists() or link.symlink_to(mine)
        for target, needle in [("", flag), (str(d / f"dir_{k}"), flag), (str(d / f"dir_{k}") + "/new/", flag),
                               (str(d / "nowhere" / "x"), flag), (str(d / f"fifo_{k}"), flag),
                               ("/proc/version", flag), (str(d / f"dir_{k}") + "/", flag)]:
            P.append(cli(["diff", *TINY, flag, target], needle))
        P.append(cli(["diff", *TINY, flag, str(mine)], flag, user_file=(mine, b"user data")))
        P.append(cli(["diff", *TINY, flag, str(link)], flag, user_file=(mine, b"user data")))
        P.append(cli(["diff", *TINY, flag, str(link), "--force"], None, expect_ok=True,
                     user_file=(mine, b"user data")))

        def appears(flag=flag, k=k):
            target = d / f"appears_{k}"
            target.unlink(missing_ok=True)
            import qsa_lab.routes.run as routes

            real = routes.run_routes

            def hook(*a, **kw):
                target.write_bytes(b"made during the run")
                return real(*a, **kw)

            routes.run_routes = hook
            code = main(["diff", *TINY, flag, str(target)])
            return {"code": code, "survived": target.read_bytes() == b"made during the run"}
        P.append(Probe("cli", f"diff {flag} <file created during the run>", appears, flag,
                       user_file=(d / f"appears_{k}", b"made during the run")))
    both = str(d / "both.out")
    P.append(cli(["diff", *TINY, "--json", both, "--save", both], "--save|--json"))
    rf = d / "repro_is_a_file"
    rf.write_text("x")
    P.append(cli(["repro", "--out", str(rf)], "--out", user_file=(rf, b"x")))
    P.append(cli(["bench", "--json", str(d / "nowhere" / "b.json")], "--json|bench"))
    return P


def load_probes(d: Path) -> list[Probe]:
    good = saved_case(d)
    blob = good.read_bytes()
    hlen = int.from_bytes(blob[:8], "little")
    files = {}

    def put(name, data):
        files[name] = d / f"{name}.safetensors"
        files[name].write_bytes(data)

    put("empty", b"")
    put("truncated by 100", blob[:-100])
    put("truncated in header", blob[:hlen // 2])
    put("7 bytes", blob[:7])
    put("png", b"\x89PNG\r\n\x1a\n" + bytes(100))
    put("json", b'{"q": [1, 2, 3]}')
    import pickle
    put("pickle", pickle.dumps({"q": torch.zeros(2)}))
    put("zip", b"PK\x03\x04" + bytes(100))
    put("huge header length", (2 ** 63).to_bytes(8, "little") + blob[8:])
    put("header length 0", bytes(8) + blob[8:])
    put("header not json", blob[:8] + b"x" * hlen + blob[8 + hlen:])
    put("header a list", len(b"[1,2]").to_bytes(8, "little") + b"[1,2]")
    for name, kw in {
        "missing kv_cache": dict(drop=["kv_cache"]),
        "missing plan": dict(drop=["plan.masks"]),
        "extra tensor": dict(add={"evil": torch.zeros(3)}),
        "q float32": dict(add={"q": torch.zeros(8, 6, 16)}),
        "q wrong shape": dict(add={"q": torch.zeros(4, 6, 16, dtype=torch.float16)}),
        "kv wrong dtype": dict(add={"kv_cache": torch.zeros(3, 2, 32, 1, 16, dtype=torch.int16)}),
        "out.grouped wrong shape": dict(add={"out.grouped": torch.zeros(3, dtype=torch.float16)}),
        "out.grouped int32": dict(add={"out.grouped": torch.zeros(8, 6, 16, dtype=torch.int32)}),
        "plan.masks wrong shape": dict(add={"plan.masks": torch.zeros(1, 8, dtype=torch.int32)}),
        "plan.seq_len float": dict(add={"plan.seq_len": torch.zeros(1)}),
        "k_scale vector": dict(add={"k_scale": torch.ones(3)}),
        "block table null block": dict(add={"block_table": torch.zeros(1, 2, dtype=torch.int32)}),
        "block table out of range": dict(add={"block_table": torch.full((1, 2), 99, dtype=torch.int32)}),
        "selected -1 first": dict(add={"selected": torch.tensor([[-1] + list(range(7))] * 8, dtype=torch.int32)}),
        "seq_lens 0": dict(add={"seq_lens": torch.zeros(1, dtype=torch.int32)}),
        "geometry not json": dict(meta={"geometry": "{rows: 8"}),
        "geometry a list": dict(meta={"geometry": "[1, 2]"}),
        "geometry rows -3": dict(meta={"geometry": json.dumps({**TINY_G.to_dict(), "rows": -3})}),
        "geometry rows 9": dict(meta={"geometry": json.dumps({**TINY_G.to_dict(), "rows": 9})}),
        "geometry unknown key": dict(meta={"geometry": json.dumps({**TINY_G.to_dict(), "colour": 1})}),
        "geometry rows a string": dict(meta={"geometry": json.dumps({**TINY_G.to_dict(), "rows": "8"})}),
        "no geometry": dict(meta={"geometry": None}),
        "kv_dtype contradicts": dict(meta={"kv_dtype": "e5m2"}),
        "sm_scale contradicts": dict(meta={"sm_scale": "0.5"}),
        "v_scale contradicts": dict(meta={"v_scale": "0.5"}),
        "k_scale nan": dict(meta={"k_scale": "nan"}),
        "k_scale text": dict(meta={"k_scale": "abc"}),
        "poison not json": dict(meta={"poison": "{"}),
        "poison a list": dict(meta={"poison": "[]"}),
        "no route outputs": dict(drop=[f"out.{r}" for r in qsa_lab.ROUTES]),
    }.items():
        files[name] = rewrite(good, d / f"{name}.safetensors", **kw)
    (d / "a folder.safetensors").mkdir(exist_ok=True)
    files["a folder"] = d / "a folder.safetensors"
    os.mkfifo(d / "fifo.safetensors")
    files["a fifo"] = d / "fifo.safetensors"
    files["missing file"] = d / "missing.safetensors"
    files["/dev/zero"] = Path("/dev/zero")
    rng = torch.Generator().manual_seed(0)
    for i in range(40):   # random header mutations
        b = bytearray(blob)
        for _ in range(1 + i % 4):
            b[8 + int(torch.randint(0, hlen, (1,), generator=rng))] = int(torch.randint(0, 256, (1,), generator=rng))
        put(f"header mutation {i}", bytes(b))
    for i in range(10):   # random truncations
        put(f"truncation {i}", blob[:int(torch.randint(0, len(blob), (1,), generator=rng))])
    # metadata that contradicts the tensors, signed again (a forgery) or unsigned (an older file): refused
    meta = json.loads(dict(__import__("safetensors").safe_open(str(good), framework="pt").metadata())["geometry"])
    poison = json.loads(dict(__import__("safetensors").safe_open(str(good), framework="pt").metadata())["poison"])
    for name, m in {"geometry seed 12345": {"geometry": json.dumps({**meta, "seed": 12345})},
                    "poison site x": {"poison": json.dumps({**poison, "site": "x"})},
                    "poison site random": {"poison": json.dumps({**poison, "site": "random"})},
                    "poison dims contradict": {"poison": json.dumps({**poison, "dims": [7]})}}.items():
        for signed in (True, False):
            f = rewrite(good, d / f"{name} {signed}.safetensors", meta={**m, "checksum": None})
            if signed:
                f.write_bytes(qio.sign(f.read_bytes()))
            files[f"{name}, {'re-signed' if signed else 'no checksum'}"] = f
    other = d / "other.safetensors"
    main(["diff", *TINY, "--poison", "random", "--poison-seed", "5", "--save", str(other)])
    ob = other.read_bytes()
    for cut in (len(blob) // 3, len(blob) // 2, len(blob) - 40):   # what a reader sees while the file is rewritten
        put(f"torn at {cut}", ob[:cut] + blob[cut:])
    P = [cli(["diff", "--load", str(p), "--backend", "emulate"], "--load") for p in files.values()]
    for pr, name in zip(P, files):
        pr.surface, pr.name = "load", f"--load <{name}>"
    # a valid file whose outputs differ from this machine's (signed after the edit): the replay says so (exit 1)
    t = rewrite(good, d / "tampered.safetensors", add={"out.grouped": torch.zeros(8, 6, 16, dtype=torch.float16)})
    t.write_bytes(qio.sign(t.read_bytes()))
    pr = cli(["diff", "--load", str(t), "--backend", "emulate"], None)
    pr.surface, pr.name = "load", "--load <tampered outputs> (replay differs)"
    P.append(pr)
    pr = cli(["diff", "--load", str(good), "--backend", "emulate"], None, expect_ok=True)
    pr.surface, pr.name = "load", "--load <a good file>"
    P.append(pr)
    return P


def api_probes(d: Path) -> list[Probe]:
    import dataclasses

    P = []
    int_fields = ["rows", "requests", "context", "topk", "page_size", "q_heads", "head_dim", "seed"]
    for f in int_fields:
        for v in ["8", 1.5, True, None, -1, 10 ** 30, 2 ** 64]:
            P.append(api(f"Geometry({f}={v!r})", lambda f=f, v=v: Geometry(**{f: v}) and None, f))
    for f in ["layout", "kv_dtype", "group_rows"]:
        for v in ["bogus", None, 3]:
            P.append(api(f"Geometry({f}={v!r})", lambda f=f, v=v: Geometry(**{f: v}) and None, f))
    for kw in [dict(topk=10 ** 9), dict(rows=65536, context=1 << 20), dict(page_size=1 << 28),
               dict(head_dim=1 << 24), dict(rows=4096, topk=65536, context=1 << 20)]:
        P.append(api(f"build_case({kw})", lambda kw=kw: build_case(Geometry(**kw)) and None,
                     "|".join(kw) + "|budget|memory"))
    case = build_case(TINY_G)
    for name, kw, needle in [
        ("dims='102'", dict(site="targeted", dims="102"), "dims"),
        ("dims='3'", dict(site="targeted", dims="3"), "dims"),
        ("dims=[1.5]", dict(site="targeted", dims=[1.5]), "dims"),
        ("dims=[True]", dict(site="targeted", dims=[True]), "dims"),
        ("dims=[16]", dict(site="targeted", dims=[16]), "dims"),
        ("dims=[-1]", dict(site="targeted", dims=[-1]), "dims"),
        ("dims=5", dict(site="targeted", dims=5), "dims"),
        ("dims=[]", dict(site="targeted", dims=[]), "dims"),
        ("dims=['a']", dict(site="targeted", dims=["a"]), "dims"),
        ("seed=-1", dict(site="random", seed=-1), "seed"),
        ("seed=2**64", dict(site="random", seed=2 ** 64), "seed"),
        ("seed=2**63", dict(site="random", seed=2 ** 63), "seed"),
        ("seed=1.5", dict(site="random", seed=1.5), "seed"),
        ("seed='3'", dict(site="random", seed="3"), "seed"),
        ("seed=None", dict(site="random", seed=None), "seed"),
        ("site='x'", dict(site="x"), "site"),
        ("plane='q'", dict(site="random", plane="q"), "plane"),
        ("stale-tail, no partial block", dict(site="stale-tail"), "stale"),
    ]:
        P.append(api(f"apply_poison({name})", lambda kw=kw: apply_poison(case, **kw) and None, needle))

    def routes_with(needle, **change):
        bad = dataclasses.replace(case, **change)
        return api(f"run_routes(case with {', '.join(change)} altered) [{needle}]",
                   lambda: run_routes(bad, backend="emulate") and None, needle)
    sel_first = case.selected.clone()
    big = build_case(TINY_G.replace(topk=32))
    row = big.selected[0]
    sel_minus = big.selected.clone()
    sel_minus[0] = torch.cat([row[row < 0], row[row >= 0]])
    P.append(api("run_routes(selected with -1 before real ids)",
                 lambda: run_routes(dataclasses.replace(big, selected=sel_minus), backend="emulate") and None,
                 "selected"))
    bt = case.block_table.clone()
    bt[0, 1] = 0
    P.append(routes_with("block_table", block_table=bt))
    P.append(routes_with("block_table", block_table=case.block_table + 1000))
    P.append(routes_with("block_table", block_table=case.block_table.long()))
    P.append(routes_with("q", q=case.q.float()))
    P.append(routes_with("q", q=case.q[:, :, :8]))
    P.append(routes_with("kv_cache", kv_cache=case.kv_cache[:, :1]))
    P.append(routes_with("kv_cache", kv_cache=case.kv_cache.half()))
    P.append(routes_with("seq_lens", seq_lens=case.seq_lens + 1000))
    P.append(routes_with("seq_lens", seq_lens=case.seq_lens * 0))
    P.append(routes_with("positions", positions=case.positions - 1000))
    P.append(routes_with("token_to_req", token_to_req=case.token_to_req + 1))
    sel_first[0, 1] = sel_first[0, 0]
    P.append(routes_with("selected", selected=sel_first))
    P.append(routes_with("selected", selected=case.selected + 100))
    P.append(routes_with("k_scale", k_scale=float("nan")))
    P.append(routes_with("v_scale", v_scale=-1.0))
    P.append(routes_with("q", q=[1, 2, 3]))
    P.append(api("run_routes(case on the meta device)", lambda: run_routes(case.to("meta"), backend="emulate")
                 and None, "device"))
    P.append(api("run_routes(q on the meta device only)", lambda: run_routes(
        dataclasses.replace(case, q=case.q.to("meta")), backend="emulate") and None, "device"))
    if not torch.cuda.is_available():
        P.append(api("run_routes(backend='cuda') without a GPU", lambda: run_routes(case, backend="cuda") and None,
                     "cuda|backend"))
    P.append(api("run_routes(routes=['magic'])", lambda: run_routes(case, routes=["magic"], backend="emulate")
                 and None, "routes"))
    P.append(api("run_routes(routes='xqa') (one name as a string)",
                 lambda: {"differs": list(run_routes(case, routes="xqa", backend="emulate").outputs) != ["xqa"]},
                 "routes", expect_ok=True))
    P.append(api("run_routes(routes=[3])", lambda: run_routes(case, routes=[3], backend="emulate") and None,
                 "routes"))
    P.append(api("run_routes(backend='tpu')", lambda: run_routes(case, backend="tpu") and None, "backend"))
    P.append(api("run_routes(not a case)", lambda: run_routes("case", backend="emulate") and None, "case"))
    from qsa_lab.model.plan import plan_groups
    from qsa_lab.routes import emulate
    from qsa_lab.routes.run import grouped_output

    plan = plan_groups(case)
    other = build_case(TINY_G.replace(seed=1))
    other_wide = build_case(TINY_G.replace(context=128, seed=1))
    for name, v in [("'fastest'", "fastest"), ("None", None), ("'UNFIXED'", "UNFIXED")]:
        P.append(api(f"grouped_output(variant={name})", lambda v=v: grouped_output(case, plan, v, emulate)
                     and None, "variant"))
    for name, oc in [("another seed", other), ("a longer context", other_wide)]:
        P.append(api(f"grouped_output(plan of {name})",
                     lambda oc=oc: grouped_output(case, plan_groups(oc), "unfixed", emulate) and None, "plan"))
    P.append(api("load(missing path)", lambda: qio.load(d / "nope.safetensors") and None, "nope|path"))
    from qsa_lab.plotting.export import export_figure

    def fig():
        from matplotlib.figure import Figure
        f = Figure(figsize=(2, 2))
        f.add_subplot().plot([0, 1])
        return f
    (d / "a_file").write_text("x")
    P.append(api("export_figure(name='../x')", lambda: export_figure(fig(), "../x", out_dir=d) and None, "name"))
    P.append(api("export_figure(name='')", lambda: export_figure(fig(), "", out_dir=d) and None, "name"))
    P.append(api("export_figure(out_dir=<a file>)", lambda: export_figure(fig(), "f", out_dir=d / "a_file")
                 and None, "out_dir|a_file", user_file=(d / "a_file", b"x")))
    (d / "exp").mkdir()
    (d / "exp" / "f.png").write_bytes(b"mine")
    P.append(api("export_figure(over an existing user PNG)", lambda: export_figure(fig(), "f", out_dir=d / "exp")
                 and None, None, expect_ok=True, user_file=(d / "exp" / "f.png", b"mine")))
    P += analysis_probes(case, d)
    P += widget_probes()
    return P


def analysis_probes(case, d: Path) -> list[Probe]:
    """The analysis functions, devices, scales, block tables, the query poison, canary dims, export names."""
    from qsa_lab.analysis import fingerprints as analysis
    from qsa_lab.model.plan import plan_groups

    P = []
    res = run_routes(apply_poison(case, "targeted", dims=[3]), backend="emulate")
    xqa_only = run_routes(case, routes=["xqa"], backend="emulate")
    out, ref = res.outputs["xqa"], res.reference64
    for name, fn, needle in [
        ("fingerprint(result without a grouped route)", lambda: analysis.fingerprint(xqa_only), "route"),
        ("fingerprint(route='magic')", lambda: analysis.fingerprint(res, "magic"), "route"),
        ("attribute(result without a grouped route)", lambda: analysis.attribute(xqa_only), "route"),
        ("attribute(route=None)", lambda: analysis.attribute(res, None), "route"),
        ("attribute(not a result)", lambda: analysis.attribute({"grouped": out}), "result"),
        ("within_tolerance(kv_dtype='int8')", lambda: analysis.within_tolerance(out, ref, "int8"), "kv_dtype"),
        ("within_tolerance(mismatched shapes)", lambda: analysis.within_tolerance(out[:1], ref, "e4m3"), "ref"),
        ("max_abs_diff(mismatched shapes)", lambda: analysis.max_abs_diff(out, out[:, :2]), "b"),
        ("max_abs_diff(a list)", lambda: analysis.max_abs_diff([1], out), "a"),
        ("build_case(device='tpu')", lambda: build_case(TINY_G, device="tpu"), "device"),
        ("build_case(device=3.5)", lambda: build_case(TINY_G, device=3.5), "device"),
        ("apply_poison(case on the meta device)", lambda: apply_poison(case.to("meta"), "targeted"), "device"),
        ("predict_nan(plan of another case)",
         lambda: analysis.predict_nan(case, plan_groups(build_case(TINY_G.replace(seed=1)))), "plan"),
        ("predict_nan(variant='fastest')", lambda: analysis.predict_nan(case, plan_groups(case), "fastest"), "variant"),
        ("predict_nan(variant='pad_fix')", lambda: analysis.predict_nan(case, plan_groups(case), "pad_fix"),
         "variant"),
        ("run_routes(routes=['xqa', 'xqa'])", lambda: run_routes(case, routes=["xqa", "xqa"], backend="emulate"),
         "routes"),
    ]:
        P.append(api(name, lambda fn=fn: fn() and None, needle))
    if not torch.cuda.is_available():
        P.append(api("build_case(device='cuda') without CUDA", lambda: build_case(TINY_G, device="cuda") and None,
                     "device"))
    import dataclasses

    bt = case.block_table.clone()
    bt[0, 1] = bt[0, 0]
    for name, change, needle in [
        ("block table: two logical pages on one physical page", dict(block_table=bt), "block_table"),
        ("positions beyond seq_len", dict(positions=case.positions + 3), "positions"),
        ("v_scale=1e300", dict(v_scale=1e300), "v_scale"), ("v_scale=1e6", dict(v_scale=1e6), "v_scale"),
        ("k_scale=1e300", dict(k_scale=1e300), "k_scale"), ("k_scale=1e-300", dict(k_scale=1e-300), "k_scale"),
    ]:
        bad = dataclasses.replace(case, **change)
        P.append(api(f"run_routes({name})", lambda bad=bad: run_routes(bad, backend="emulate") and None, needle))

    def nan_query_warned():
        import warnings

        q = case.q.clone()
        q[0, 0, 0] = float("nan")
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            r = run_routes(dataclasses.replace(case, q=q), backend="emulate")
        hidden = bool(torch.isnan(r.outputs["xqa"][0]).any()) and not bool(torch.isnan(r.outputs["grouped"][0]).any())
        return {"differs": hidden and not any("q: rows" in str(x.message) for x in w)}
    P.append(api("a NaN in q no poison explains (warned)", nan_query_warned, None, expect_ok=True))

    def query_site_predicted():
        qc = apply_poison(build_case(TINY_G.replace(rows=11)), "query", dims=[2])
        r = run_routes(qc, backend="emulate")
        return {"differs": not torch.equal(analysis.predict_nan(qc, r.plan), torch.isnan(r.outputs["grouped"]))
                or int(torch.isnan(r.outputs["xqa"]).sum()) != 11 * 6 * 16}
    P.append(api("poison site 'query': XQA NaN, grouped rows predicted", query_site_predicted, None,
                 expect_ok=True))
    from qsa_lab.canary import run_canary

    for v in ["12", [5.9], [True], ["3"], [99]]:
        P.append(api(f"run_canary(dims={v!r})", lambda v=v: run_canary(["qsa:xqa"], regions=["null-block"],
                                                                         payloads=["nan"], backend="emulate",
                                                                         dims=v) and None, "dims"))
    from qsa_lab.plotting.export import export_figure

    def fig():
        from matplotlib.figure import Figure
        f = Figure(figsize=(2, 2))
        f.add_subplot().plot([0, 1])
        return f
    (d / "names").mkdir()
    for v in ["..", ".", ".hidden", "a/b", None]:
        P.append(api(f"export_figure(name={v!r})", lambda v=v: export_figure(fig(), v, out_dir=d / "names")
                     and None, "name"))
    P.append(api("export_figure(...) leaves no hidden file", lambda: {"differs": any(
        p.name.startswith(".") for p in (d / "names").iterdir())}, None, expect_ok=True))
    return P


def widget_probes() -> list[Probe]:
    """The playground and the notebooks' backend switch."""
    from qsa_lab.analysis.notebook import notebook_backend
    from qsa_lab.analysis.playground import Params
    from qsa_lab.widgets import Playground

    P = []
    for kw, needle in [(dict(preset="bogus"), "preset"), (dict(site="x"), "site"), (dict(plane="q"), "plane"),
                       (dict(kv_dtype="int8"), "kv_dtype"), (dict(backend="CUDA"), "backend"),
                       (dict(dims=("a",)), "dims"), (dict(dims=(999,)), "dims"), (dict(seed=-1), "seed"),
                       (dict(fixes=("magic",)), "fixes"), (dict(nan_map="reference?"), "nan_map"),
                       (dict(site="stale-tail"), "site")]:
        P.append(api(f"Playground(Params({kw}))", lambda kw=kw: Playground(Params(**kw)) and None, needle))
    P.append(api("Playground('not params')", lambda: Playground("x") and None, "params"))

    pg = Playground(Params(backend="emulate"))  # built once here; each forked probe redraws its own copy

    def set_bad(**values):
        def fn():
            if not pg.set(**values):
                raise ValueError(__import__("re").sub("<[^>]+>", "", pg.message.value))
            return {"differs": True}
        return fn
    for values, needle in [(dict(site="bogus"), "site"), (dict(dims="1,x"), "dims"), (dict(seed="-3"), "seed"),
                           (dict(geometry="bogus"), "geometry")]:
        P.append(api(f"Playground.set({values})", set_bad(**values), needle))
    for v in ["bogus", "", "CUDA"] + ([] if torch.cuda.is_available() else ["cuda"]):
        P.append(api(f"QSA_LAB_BACKEND={v!r} in a notebook -> emulation",
                     lambda v=v: {"differs": notebook_backend(v) != "emulate"}, None, expect_ok=True))
    return P


def repro_probes(d: Path) -> list[Probe]:
    """Same inputs twice: the files must be byte-identical."""
    def twice(kind):
        def fn():
            a, b = d / f"{kind}_a", d / f"{kind}_b"
            for folder in (a, b):
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
            if kind in ("json", "safetensors"):
                for folder in (a, b):
                    flag = "--json" if kind == "json" else "--save"
                    main(["diff", *TINY, "--poison", "random", flag, str(folder / f"x.{kind}")])
                    time.sleep(1.1)
                return {"differs": (a / f"x.{kind}").read_bytes() != (b / f"x.{kind}").read_bytes()}
            if kind == "csv":
                from qsa_lab.report.repro import REPRO_CASES, run_repro
                for folder in (a, b):
                    table, _ = run_repro(cases=REPRO_CASES[:2], progress=False, backend="emulate",
                                         geometry_overrides=dict(context=64, topk=8, head_dim=16))
                    table.to_csv(folder / "x.csv", index=False)
                return {"differs": (a / "x.csv").read_bytes() != (b / "x.csv").read_bytes()}
            from matplotlib.figure import Figure

            from qsa_lab.plotting.export import export_figure
            paths = []
            for folder in (a, b):
                f = Figure(figsize=(2, 2))
                f.add_subplot().plot([0, 1], label="x")
                paths.append(export_figure(f, "f", {"case": "tiny"}, out_dir=folder))
                time.sleep(1.1)
            i = ["png", "svg", "pdf"].index(kind)
            return {"differs": paths[0][i].read_bytes() != paths[1][i].read_bytes()}
        return fn
    return [Probe("repro", f"same inputs twice: {k}", twice(k), None, expect_ok=True)
            for k in ("json", "safetensors", "csv", "png", "svg", "pdf")]


# ---------------------------------------------------------------- issue 40's surfaces (Reliability IV)

def iv_probes(d: Path) -> list[Probe]:
    """Replay in a received folder, other-requests at any request count, the canary at real models'
    geometries and its memory budget, the scribble's bad input, nothing-checked runs and stray writes,
    the API errors, escapes, old names, signals, float8 from a worker, case-file shapes, killed reports."""
    import signal
    import subprocess
    import textwrap

    from safetensors.torch import save_file

    from qsa_lab.canary import register_kernel, run_canary
    from qsa_lab.canary.calls import save_call
    from qsa_lab.canary.case import canary_case, load_case
    from qsa_lab.model.plan import pad_fix, plan_groups
    from qsa_lab.model.regions import region_slots

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    qsa = str(Path(sys.executable).parent / "qsa-lab")
    P = []

    def iv_cli(argv, needle, **kw):
        p = cli(argv, needle, **kw)
        p.surface = "iv"
        return p

    def iv_api(name, fn, needle, **kw):
        return Probe("iv", name, fn, needle, is_cli=False, **kw)

    # the API errors the issue lists
    for name, fn, needle in [
            ("plan_groups(None)", lambda: plan_groups(None), "case"), ("pad_fix(None)", lambda: pad_fix(None), "plan"),
            ("run_canary(timeout=inf)", lambda: run_canary(["torch:sdpa-math"], timeout=float("inf")), "timeout"),
            ("canary_case(free_pages=10**9)", lambda: canary_case(free_pages=10 ** 9), "free_pages"),
            ("register_kernel('lib:k', 42)", lambda: register_kernel("lib:k", 42), "fn"),
            ("build_case(max_memory='1M')", lambda: build_case(max_memory="1M"), "max_memory"),
            ("build_case(max_memory=nan)", lambda: build_case(max_memory=float("nan")), "max_memory"),
            ("build_case(max_memory=-1)", lambda: build_case(max_memory=-1), "max_memory"),
            ("load_case(None)", lambda: load_case(None), "path"),
            ("canary_case(q_heads=512)", lambda: canary_case(q_heads=512), "q_heads"),
            ("canary_case(q_heads=32, kv_heads=5)", lambda: canary_case(q_heads=32, kv_heads=5), "kv_heads")]:
        P.append(iv_api(name, lambda fn=fn: fn() and None, needle))

    # real models' geometries: built, judged, the qsa: kernels skipped saying why
    def geometry(**kw):
        def fn():
            r = run_canary(["torch:sdpa-math", "qsa:grouped"], regions=["stale-tail"], payloads=["nan"], planes=["v"],
                           attend="dense", backend="emulate", **kw)
            why = [s["reason"] for s in r.skipped if s.get("kernel") == "qsa:grouped"]
            return {"differs": r.find("torch:sdpa-math", "stale-tail", "v", "nan").verdict != "nan-leak"
                    or not why or "query heads" not in why[0] and "KV head" not in why[0] and "MLA" not in why[0]}
        return fn
    for kw in (dict(q_heads=32, kv_heads=8, head_dim=128), dict(q_heads=128, kv_heads=8, head_dim=128),
               dict(q_heads=64, kv_heads=64, head_dim=64), dict(q_heads=16, kv_heads=2, head_dim=256),
               dict(q_heads=128, mla=True, head_dim=576, v_head_dim=512)):
        P.append(iv_api(f"canary at {kw}", geometry(**kw), None, expect_ok=True))
    for argv, needle in [(["--q-heads", "512"], "--q-heads"), (["--q-heads", "32", "--kv-heads", "5"], "--kv-heads"),
                         (["--head-dim", "100"], "--head-dim"), (["--free-pages", str(10 ** 9)], "--free-pages"),
                         (["--max-memory", "nan"], "--max-memory"), (["--max-memory", "-1"], "--max-memory"),
                         (["--timeout", "1e300"], "--timeout"), (["--context", "1048576", "--requests", "4096",
                                                                 "--rows", "4096"], "--context|--requests|--rows")]:
        P.append(iv_cli(["canary", "--kernels", "torch:sdpa-math", "--backend", "emulate", *argv], needle))

    # other-requests: request 0 reads request 1's page, any request count
    sys.path.insert(0, str(root / "tests"))
    import canary_kernels as ck
    for n in (3, 5, 8, 16):
        P.append(iv_api(f"other-requests, request 0 reads request 1, {n} requests", lambda n=n: {"differs": run_canary(
            {"k": ck.request0_reads_request1}, regions=["other-requests"], payloads=["nan"], planes=["v"],
            backend="emulate", requests=n, rows=2 * n, context=40, free_pages=0).exit_code() != 1}, None,
            expect_ok=True))

    # replay inside a received folder holding modules that leave a marker when imported
    rep = d / "received"
    case = canary_case()
    call = rep / "calls" / "c.safetensors"
    save_call(call, case, "torch:sdpa-math", "stale-tail", "v", "nan", region_slots(case, "stale-tail"), None,
              "nan-leak", {}, {})
    marks = d / "marks"
    marks.mkdir()
    for name in ("shlex", "torch", "argparse", "json", "__future__", "numpy"):
        (rep / f"{name}.py").write_text(f"open({str(marks / name)!r}, 'w').write('x')\n")
    for name in ("safetensors", "qsa_lab"):
        (rep / name).mkdir()
        (rep / name / "__init__.py").write_text(f"open({str(marks / name)!r}, 'w').write('x')\n")

    def replay_in_folder(argv):
        def fn():
            p = subprocess.run(argv, cwd=rep, capture_output=True, text=True, timeout=300,
                               env={k: v for k, v in env.items() if k != "PYTHONPATH"})
            return {"differs": bool(list(marks.iterdir())) or p.returncode != 1}
        return fn
    P.append(iv_api("qsa-lab replay in a folder holding shlex.py, torch.py, qsa_lab/ ...",
                    replay_in_folder([qsa, "replay", "calls/c.safetensors", "--backend", "emulate"]), None,
                    expect_ok=True))
    forged = d / "forged.safetensors"
    for name, meta in [("a forged kernel name's escape codes", {"kernel": "torch:sdpa-math\x1b[2J\nverdict clean"}),
                       ("forged region / verdict text", {"region": "\x1b[31mx\ny", "verdict": "clean\r"})]:
        def escaped(meta=meta):
            from safetensors import safe_open
            with safe_open(str(call), framework="pt") as f:
                old, t = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
            save_file(t, str(forged), metadata={**old, **meta})
            out, err = _io.StringIO(), _io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                main(["replay", str(forged), "--backend", "emulate"])
            text = out.getvalue() + err.getvalue()
            return {"differs": "\x1b" in text or "\r" in text}
        P.append(iv_api(f"replay prints {name} escaped", escaped, None, expect_ok=True))

    def old_name():
        from safetensors import safe_open
        with safe_open(str(call), framework="pt") as f:
            old, t = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
        save_file(t, str(d / "old.safetensors"), metadata={**old, "kernel": "qsa:fixA"})
        return {"code": main(["replay", str(d / "old.safetensors")])}
    P.append(Probe("iv", "replay of a call file naming qsa:fixA", old_name, "CALL_FILE", is_cli=True))

    # case files of the wrong shape
    good = {"kv_cache": case.kv_cache, "block_table": case.block_table, "seq_lens": case.seq_lens, "q": case.q,
            "selected": case.selected}
    for name, t in [("seq_lens", torch.tensor(33, dtype=torch.int32)), ("seq_lens", torch.zeros(0, dtype=torch.int32)),
                    ("q", torch.zeros((), dtype=torch.float16)), ("query_lens", torch.tensor([5, 5], dtype=torch.int32)),
                    ("token_to_req", torch.full((10,), 7, dtype=torch.int32)),
                    ("block_table", torch.zeros(3, dtype=torch.int32))]:
        f = d / f"case_{name}_{len(P)}.safetensors"
        save_file({k: v.contiguous() for k, v in {**good, name: t}.items()}, str(f))
        P.append(iv_cli(["canary", "--case", str(f), "--kernels", "torch:sdpa-math"], "--case"))

    # a worker kernel's float8 output
    (d / "f8.py").write_text("import torch\nimport canary_kernels as ck\n\n"
                             "def attn(call):\n    return ck.zero_times_v(call).float().to(torch.float8_e4m3fn)\n")
    P.append(iv_api("float8 output from a worker kernel", lambda: {"differs": run_canary(
        [f"{d / 'f8.py'}:attn"], regions=["stale-tail"], payloads=["nan"], planes=["v"],
        backend="emulate").results[0].verdict != "nan-leak"}, None, expect_ok=True))

    # SIGINT while diff publishes --json and --save: both or neither
    signal_at = textwrap.dedent('''
        import os, signal, sys
        from qsa_lab.support import outputs
        publish, seen = outputs._publish, []
        def publishing(*a):
            seen.append(1)
            publish(*a)
            if len(seen) == 1:
                os.kill(os.getpid(), signal.SIGINT)
        outputs._publish = publishing
        sys.argv = ["qsa-lab", *sys.argv[1:]]
        from qsa_lab.app.cli import main
        main()
    ''')

    def both_or_neither():
        out = d / "sig"
        out.mkdir()
        p = subprocess.run([sys.executable, "-c", signal_at, "diff", *TINY, "--json", str(out / "a.json"), "--save",
                            str(out / "a.safetensors")], capture_output=True, timeout=300, env=env)
        left = sorted(x.name for x in out.iterdir())
        return {"differs": (p.returncode, left) not in ((130, []), (0, ["a.json", "a.safetensors"]))}
    P.append(iv_api("SIGINT between diff's two publishes", both_or_neither, None, expect_ok=True))

    # a killed --report, then the next run
    def killed_report():
        target = d / "rep"
        subprocess.run([sys.executable, "-c", "import os, signal, sys\nfrom qsa_lab.support.outputs import "
                        "writing_folder\nwith writing_folder(sys.argv[1]) as t:\n    os.kill(os.getpid(), "
                        "signal.SIGKILL)\n", str(target)], timeout=120, env=env)
        main(["canary", "--kernels", "torch:sdpa-math", "--regions", "null-block", "--payloads", "nan", "--planes",
              "v", "--backend", "emulate", "--report", str(target)])
        return {"differs": any(x.name.startswith(".rep.partial") for x in d.iterdir())}
    P.append(iv_api("a killed --report's partial folder, then a run", killed_report, None, expect_ok=True))

    # the scribble: bad input, inputs never written, nothing checked, stray writes in read runs
    try:
        from qsa_lab.scribble.models import tiny_model
    except ImportError:
        return P
    ck_dir = d / "ckpt"
    tiny_model("llama-gqa").save_pretrained(ck_dir)
    for name in ("empty", "notjson", "zeroheads", "truncated", "nokv", "manylayers"):
        shutil.copytree(ck_dir, d / name) if name != "empty" else (d / name).mkdir()
    (d / "notjson" / "config.json").write_text("{x")
    cfg = json.loads((ck_dir / "config.json").read_text())
    (d / "zeroheads" / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 0}))
    (d / "nokv" / "config.json").write_text(json.dumps({**cfg, "num_key_value_heads": 3}))
    (d / "manylayers" / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 10 ** 9}))
    w = d / "truncated" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    small = ["--regions", "read-trash", "--payloads", "nan", "--device", "cpu"]
    for m in ("empty", "notjson", "zeroheads", "truncated", "nokv", "manylayers", "nowhere"):
        P.append(iv_cli(["scribble", "--model", str(d / m), *small], "--model"))
    (d / "attention.py").write_text("def attention(*a, **k):\n    return None\n")
    for attn in ("", str(d / "attention.py"), "os:", ":f", "no-such-attention"):
        P.append(iv_cli(["scribble", "--attn", attn, *small], "--attn"))
    P.append(iv_cli(["scribble", "--model", "", *small], "--model"))
    P.append(iv_cli(["scribble", "--seed", str(2 ** 64), *small], "--seed"))
    P.append(iv_cli(["scribble", "--model", str(ck_dir), "--json", str(ck_dir / "config.json"), "--force", *small],
                    "--json", user_file=(ck_dir / "config.json", (ck_dir / "config.json").read_bytes())))
    P.append(iv_api("scribble --model mistral-swa --regions out-of-window (every cell n/a)", lambda: {
        "differs": main(["scribble", "--model", "mistral-swa", "--regions", "out-of-window", "--payloads", "nan",
                         "--device", "cpu"]) != 3}, None, expect_ok=True))

    def scribble_api(**kw):
        from qsa_lab.scribble.check import scribble
        from qsa_lab.scribble.engines.transformers import TransformersEngine
        from qsa_lab.scribble.models import workload
        return scribble(TransformersEngine(tiny_model("llama-gqa"), workload("chunked-prefill")), **kw)
    P.append(iv_api("scribble(engine, regions=[])", lambda: scribble_api(regions=[]) and None, "regions"))
    P.append(iv_api("scribble(regions twice, payloads twice) runs each once", lambda: {"differs": len(scribble_api(
        regions=("read-trash", "read-trash"), payloads=("nan", "nan")).cells) != 2}, None, expect_ok=True))

    def scrubbing_attention():
        from transformers import AttentionInterface
        from transformers.integrations.eager_paged import eager_paged_attention_forward

        from qsa_lab.scribble.check import scribble
        from qsa_lab.scribble.engines.transformers import TransformersEngine
        from qsa_lab.scribble.models import workload
        eng = TransformersEngine(tiny_model("llama-gqa"), workload("chunked-prefill"))

        def scrub(module, query, key, value, attention_mask, scaling, **kw):
            rows = eng.cache.cache_tensor.view(eng.cache.dtype)
            rows.masked_fill_(rows.isnan(), 0.0)
            return eager_paged_attention_forward(module, query, key, value, attention_mask, scaling, **kw)
        AttentionInterface.register("paged|eager", scrub)
        r = scribble(eng, regions=("free-blocks",), payloads=("nan",))
        return {"differs": r.exit_code() != 1}
    P.append(iv_api("an attention scrubbing NaN in the pool in place (stray writes in a read run)",
                    scrubbing_attention, None, expect_ok=True))
    return P


def main_(argv=None):
    global TIMEOUT_S
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write every probe's outcome here")
    ap.add_argument("--show", default="", help="print probes of these classes (comma-separated)")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help=f"seconds per probe (default {TIMEOUT_S})")
    a = ap.parse_args(argv)
    TIMEOUT_S = a.timeout
    d = Path(tempfile.mkdtemp(prefix="hostile_"))
    probes = cli_probes(d) + load_probes(d) + api_probes(d) + repro_probes(d) + iv_probes(d)
    print(f"qsa_lab from {Path(qsa_lab.__file__).parent}; {len(probes)} probes", file=sys.stderr)
    table = collections.defaultdict(collections.Counter)
    records = []
    t0 = time.time()
    for i, p in enumerate(probes):
        cls, res = run_probe(p)
        table[p.surface][cls] += 1
        records.append({"surface": p.surface, "probe": p.name, "class": cls,
                        "detail": (res.get("stderr") or res.get("msg") or "").strip()[-300:]})
        if cls in a.show.split(","):
            print(f"[{cls}] {p.surface}: {p.name}\n    {records[-1]['detail'][-200:]!r}", file=sys.stderr)
    print(f"{len(probes)} probes in {time.time() - t0:.0f} s\n")
    print("| surface | " + " | ".join(CLASSES) + " | total |")
    print("|---|" + "---|" * (len(CLASSES) + 1))
    total = collections.Counter()
    for s in ("cli", "load", "api", "repro", "iv"):
        total.update(table[s])
        print(f"| {s} | " + " | ".join(str(table[s][c]) for c in CLASSES) + f" | {sum(table[s].values())} |")
    print("| all | " + " | ".join(str(total[c]) for c in CLASSES) + f" | {sum(total.values())} |")
    if a.json:
        Path(a.json).write_text(json.dumps(records, indent=1))
    shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main_()
