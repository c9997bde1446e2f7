"""CLI JSON, --save / --load round trip (acceptance 7) and the repro command."""
import json

import torch
from safetensors import safe_open

from qsa_lab.app import case_file as io
from qsa_lab.app.cli import main
from qsa_lab.model.poison import REPORT_DIMS
from qsa_lab.routes.run import ROUTES

ARGS = ["diff", "--rows", "19", "--poison", "targeted", "--dims", ",".join(map(str, REPORT_DIMS)),
        "--backend", "emulate"]


def test_diff_json_follows_the_contract(capsys):
    assert main(ARGS + ["--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "qsa_lab.diff/1" and doc["backend"] == "emulate"
    assert set(doc["geometry"]) == {"rows", "requests", "layout", "context", "topk", "page_size", "q_heads",
                                    "head_dim", "kv_dtype", "group_rows", "seed", "selection", "overlap"}
    assert doc["poison"] == {"site": "targeted", "plane": "v", "nan_bytes": 20, "poisoned_dims": list(REPORT_DIMS)}
    assert set(doc["routes"]) == set(ROUTES)
    assert doc["routes"]["grouped"]["nan_count"] == 480 and doc["routes"]["grouped"]["nan_dims"] == list(REPORT_DIMS)
    assert doc["routes"]["grouped"]["max_abs_diff_vs_reference"] is None
    assert doc["routes"]["grouped+kernel_fix"]["max_abs_diff_vs_xqa"] < 1e-3
    g0 = doc["groups"][0]
    assert g0["rows"] == list(range(8)) and g0["tiles"] * 32 == sum(
        4 * (c["real"] + c["padded"]) for c in g0["categories"].values())
    assert all((c["real"] + c["padded"]) % 8 == 0 for g in doc["groups"] for c in g["categories"].values())


def test_save_then_load_replays_bit_identically(tmp_path, capsys):
    path = tmp_path / "case.safetensors"
    assert main(ARGS + ["--save", str(path)]) == 0
    with safe_open(str(path), framework="pt") as f:
        keys, meta = set(f.keys()), f.metadata()
    assert {"q", "kv_cache", "k_scale", "v_scale", "block_table", "seq_lens", "token_to_req", "positions",
            "selected", "plan.microblocks", "plan.masks", "plan.seq_len"} <= keys
    assert {f"out.{r}" for r in ROUTES} <= keys
    assert {"geometry", "kv_dtype", "sm_scale", "qsa_lab_version"} <= set(meta)
    case, plan, outputs, _ = io.load(path)
    assert plan.masks.dtype == torch.int32 and plan.microblocks.shape[0] == 2
    capsys.readouterr()
    assert main(["diff", "--load", str(path), "--backend", "emulate"]) == 0
    assert "bit-identical" in capsys.readouterr().out
    # a saved file is never overwritten without asking, nor a JSON report
    before = path.read_bytes()
    assert main(ARGS + ["--save", str(path)]) == 2
    assert path.read_bytes() == before
    report = tmp_path / "r.json"
    report.write_text("mine")
    assert main(ARGS + ["--json", str(report)]) == 2 and report.read_text() == "mine"
    # a replay whose saved outputs were tampered with is reported, exit 1
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(path))
    tensors["out.grouped"] = torch.zeros_like(tensors["out.grouped"])
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tampered = tmp_path / "tampered.safetensors"
    save_file(tensors, str(tampered), metadata=meta)
    capsys.readouterr()
    # ... as an edit that the checksum catches (exit 2), and once re-signed as a replay that differs (exit 1)
    assert main(["diff", "--load", str(tampered), "--backend", "emulate"]) == 2
    assert "checksum mismatch" in capsys.readouterr().err
    tampered.write_bytes(io.sign(tampered.read_bytes()))
    assert main(["diff", "--load", str(tampered), "--backend", "emulate"]) == 1
    assert "DIFFERS on ['grouped']" in capsys.readouterr().out


def test_load_refuses_a_foreign_file(tmp_path):
    from safetensors.torch import save_file
    p = tmp_path / "x.safetensors"
    save_file({"a": torch.zeros(1)}, str(p))
    assert main(["diff", "--load", str(p)]) == 2


def test_payload_option_reaches_the_poison(capsys):
    """--payload inf on an E5M2 attended key: the grouped route drops the Inf key (finite),
    XQA turns it into NaN; an E4M3 cache has no Inf code, named as --payload."""
    import json

    from qsa_lab.app.cli import main

    base = ["diff", "--rows", "16", "--context", "300", "--topk", "24", "--head-dim", "32", "--poison", "attended-k",
            "--backend", "emulate", "--json", "-"]
    assert main(base + ["--kv-dtype", "e5m2", "--payload", "inf"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["routes"]["grouped"]["nan_count"] == 0 and doc["routes"]["xqa"]["nan_count"] > 0
    assert main(base + ["--payload", "inf"]) == 2
    assert capsys.readouterr().err.strip() == "qsa-lab: error: --payload: e4m3 has no inf encoding"


def test_group_rows_has_one_name_and_the_old_one_still_reads(capsys, tmp_path):
    """--group-rows is the option of Geometry.group_rows (the JSON's key); --grouping, its old name,
    still works (not shown in --help), and a case file whose geometry says "grouping" replays."""
    import struct

    assert main(ARGS + ["--group-rows", "request", "--json", "-"]) == 0
    new = json.loads(capsys.readouterr().out)
    assert main(ARGS + ["--grouping", "request", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out) == new and new["geometry"]["group_rows"] == "request"
    assert main(["diff", "--help"]) == 0
    assert "--group-rows" in (text := capsys.readouterr().out) and "--grouping" not in text

    path = tmp_path / "old.safetensors"
    assert main(ARGS + ["--group-rows", "request", "--save", str(path)]) == 0
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    geo = json.loads(header["__metadata__"]["geometry"])
    geo["grouping"] = geo.pop("group_rows")                    # as a file written under the old name
    header["__metadata__"]["geometry"] = json.dumps(geo)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(io.sign(struct.pack("<Q", len(text)) + text + blob[8 + n:]))
    capsys.readouterr()
    assert main(["diff", "--load", str(path), "--backend", "emulate"]) == 0, capsys.readouterr().err
    assert io.load(path, "--load")[0].geometry.group_rows == "request"
