"""Throw a few hundred hostile inputs at qsa_lab and classify what happens to each.

    python scripts/hostile_inputs.py                    # the qsa_lab on sys.path
    cd /tmp && PYTHONPATH=/path/to/other/checkout python /path/to/hostile_inputs.py

Surfaces: the CLI (`qsa_lab.app.cli.main`, in-process), the Python API (case building, poison,
routes, analysis, canary, export, the playground widget and the notebooks' backend switch),
and loading saved files (corrupt, torn, contradicting their metadata).
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
    def __init__(self, surface, name, fn, needle=None, expect_ok=False, user_file=None):
        self.surface, self.name, self.fn, self.needle = surface, name, fn, needle
        self.is_cli = surface in ("cli", "load")
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
    for flag, v in [("--layout", "spiral"), ("--kv-dtype", "int4"), ("--grouping", "x"), ("--poison", "all"),
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


def main_(argv=None):
    global TIMEOUT_S
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write every probe's outcome here")
    ap.add_argument("--show", default="", help="print probes of these classes (comma-separated)")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help=f"seconds per probe (default {TIMEOUT_S})")
    a = ap.parse_args(argv)
    TIMEOUT_S = a.timeout
    d = Path(tempfile.mkdtemp(prefix="hostile_"))
    probes = cli_probes(d) + load_probes(d) + api_probes(d) + repro_probes(d)
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
    for s in ("cli", "load", "api", "repro"):
        total.update(table[s])
        print(f"| {s} | " + " | ".join(str(table[s][c]) for c in CLASSES) + f" | {sum(table[s].values())} |")
    print("| all | " + " | ".join(str(total[c]) for c in CLASSES) + f" | {sum(total.values())} |")
    if a.json:
        Path(a.json).write_text(json.dumps(records, indent=1))
    shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main_()
