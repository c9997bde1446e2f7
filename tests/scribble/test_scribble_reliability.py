"""The scribble's Reliability IV (issue 40): it never passes on nothing, a read run's own stray writes
are never clean, it never writes onto what it reads, and every bad input is one line, exit 2, before
anything loads."""
import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qsa_lab.app.cli import main  # noqa: E402
from qsa_lab.scribble.check import scribble  # noqa: E402
from qsa_lab.scribble.engines.transformers import TransformersEngine  # noqa: E402
from qsa_lab.scribble.models import tiny_model, workload  # noqa: E402


def engine(name="llama-gqa"):
    return TransformersEngine(tiny_model(name), workload("chunked-prefill"))


def run_cli(argv, capsys):
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_an_attention_that_scrubs_the_pool_in_place_is_a_stray_write_not_clean():
    """It reads nothing it must not (its outputs never change) but writes zeros over every NaN it finds
    in the pool: in the read run of free-blocks that is a write into rows no step may write."""
    from transformers import AttentionInterface
    from transformers.integrations.eager_paged import eager_paged_attention_forward

    eng = engine()

    def scrubbing(module, query, key, value, attention_mask, scaling, **kwargs):
        rows = eng.cache.cache_tensor.view(eng.cache.dtype)
        rows.masked_fill_(rows.isnan(), 0.0)
        return eager_paged_attention_forward(module, query, key, value, attention_mask, scaling, **kwargs)

    AttentionInterface.register("paged|eager", scrubbing)
    try:
        report = scribble(eng, regions=("free-blocks",), payloads=("nan",))
    finally:
        AttentionInterface.register("paged|eager", eager_paged_attention_forward)
    (read,) = [c for c in report.cells if c.check == "read"]
    assert read.verdict == "stray-write" and read.strays and read.nan == 0 and read.tokens_changed == 0
    assert all(s["region"] == "free-blocks" for s in read.strays)
    assert report.exit_code() == 1


def test_no_region_is_refused_and_a_name_given_twice_runs_once():
    with pytest.raises(ValueError, match="^regions: empty"):
        scribble(engine(), regions=[])
    report = scribble(engine(), regions=("read-trash", "read-trash"), payloads=("nan", "nan"))
    assert [(c.check, c.region, c.payload) for c in report.cells] == [("write", "read-trash", "-"),
                                                                      ("read", "read-trash", "nan")]


def test_every_cell_n_a_is_no_pass(capsys):
    report = scribble(engine("mistral-swa"), regions=("out-of-window",), payloads=("nan",))
    assert {c.verdict for c in report.cells} == {"n/a"} and report.exit_code() == 3
    code, out, err = run_cli(["scribble", "--model", "mistral-swa", "--regions", "out-of-window", "--payloads",
                              "nan", "--device", "cpu"], capsys)
    assert code == 3 and err.strip() == ("qsa-lab: scribble: no check ran: every cell is n/a (no region asked for "
                                         "held a row in any step)")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A good tiny checkpoint and damaged copies of it."""
    root = tmp_path_factory.mktemp("checkpoints")
    good = root / "good"
    tiny_model("llama-gqa").save_pretrained(good)
    (root / "empty").mkdir()
    for name in ("not-json", "zero-heads", "truncated", "no-weights", "list", "many-layers"):
        shutil.copytree(good, root / name)
    (root / "not-json" / "config.json").write_text("{not json")
    (root / "list" / "config.json").write_text("[1, 2]")
    config = json.loads((good / "config.json").read_text())
    (root / "zero-heads" / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0}))
    (root / "many-layers" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10 ** 9}))
    weights = root / "truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (root / "no-weights" / "model.safetensors").unlink()
    return root


BAD = [(["--model", "{root}/empty"], "--model: {root}/empty holds no config.json"),
       (["--model", "{root}/not-json"], "--model: {root}/not-json/config.json is not JSON"),
       (["--model", "{root}/list"], "--model: {root}/list/config.json holds a list, not a JSON object"),
       (["--model", "{root}/zero-heads"], "--model: {root}/zero-heads/config.json: num_attention_heads must be an "
                                         "int >= 1, got 0"),
       (["--model", "{root}/truncated"], "--model: {root}/truncated/model.safetensors is truncated or damaged"),
       (["--model", "{root}/no-weights"], "--model: {root}/no-weights holds no weights"),
       (["--model", ""], "--model: empty"),
       (["--engine", "vllm", "--model", "bogus"], "--model: 'bogus' is neither a built-in tiny model (llama-gqa, "
                                                  "mistral-swa, mixtral-moe) nor a local folder"),
       (["--engine", "vllm", "--model", "{root}/good"], "--model: {root}/good: head dim 16: vLLM 0.32.0's CPU "
                                                        "attention runs head dims 32, 64, 80, 96, 112, 128, 160, 192, "
                                                        "224, 256, 512 only"),
       (["--attn", ""], "--attn: empty"),
       (["--attn", "{root}/attention.py"], "--attn: '{root}/attention.py' names no function"),
       (["--attn", "os:"], "--attn: 'os:' names no function"),
       (["--seed", str(2 ** 64)], "--seed: must be in 0..9223372036854775807, got 18446744073709551616"),
       (["--model", "{root}/good", "--json", "{root}/good/config.json", "--force"],
        "--json: same file as --model config.json")]


@pytest.mark.parametrize("argv,line", BAD, ids=[" ".join(a[:2]).rsplit("/", 1)[-1] for a, _ in BAD])
def test_bad_input_is_one_line_exit_2_before_anything_loads(argv, line, checkpoints, capsys):
    before = (checkpoints / "good" / "config.json").read_bytes()
    argv = [a.format(root=checkpoints) for a in argv]
    code, out, err = run_cli(["scribble", *argv, "--regions", "read-trash", "--payloads", "nan"], capsys)
    assert code == 2 and out == "", (code, out, err)
    assert len(err.splitlines()) == 1 and err.startswith("qsa-lab: error: " + line.format(root=checkpoints)), err
    assert (checkpoints / "good" / "config.json").read_bytes() == before


def test_a_good_checkpoint_loads_without_loader_output(checkpoints, capsys):
    from qsa_lab.scribble.models import local_model

    capsys.readouterr()
    model = local_model(str(checkpoints / "good"))
    out, err = capsys.readouterr()
    assert (out, err) == ("", "") and type(model).__name__ == "LlamaForCausalLM"


@pytest.mark.parametrize("name", ["no-such-attention", ":f"])
def test_an_attention_name_transformers_cannot_use_is_bad_input(name, capsys):
    """Refused by the engine (transformers knows its names), still one line, exit 2, naming --attn."""
    code, out, err = run_cli(["scribble", "--attn", name, "--regions", "read-trash", "--payloads", "nan",
                              "--device", "cpu"], capsys)
    assert code == 2 and out == "" and len(err.splitlines()) == 1, (code, out, err)
    assert err.startswith(f"qsa-lab: error: --attn: transformers {transformers.__version__} cannot use {name!r}"), err


def test_a_config_bigger_than_its_weights_is_refused_before_the_loader_builds_it(checkpoints):
    """10**9 layers in a config beside 0.4 MB of weights: the loader would build modules for minutes."""
    from qsa_lab.scribble.models import CheckpointError, check_checkpoint

    with pytest.raises(CheckpointError, match=r"^model: .*many-layers/config.json describes at least 6.4e\+10 "
                                              r"weights .*, but the folder's weights are \d+ bytes$"):
        check_checkpoint(checkpoints / "many-layers")
    assert check_checkpoint(checkpoints / "good")["num_hidden_layers"] == 2
