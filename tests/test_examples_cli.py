"""The example training scripts' command line (scripts/train_*.py, scripts/launch_*.sh, both ending in
lossless_hc.bench.workloads.train): a user's mistake is one error line naming the option and what it
takes, refused at argument parsing on every rank, never a traceback per rank nor a silent wrong run.

* the launcher picks the default --framework (ddp under torchrun, horovod otherwise) and refuses a
  framework that the launcher cannot start (each rank would train alone, or not start at all);
* bad option values (ratios, THC's bits, counts, an absent CUDA device) end at parsing;
* the launch scripts refuse a worker count that is not a positive integer (horovodrun -np 0 exits 0);
* --help lists the modes of each framework, from SUPPORTED; the scripts' docstrings point to it;
* no module that FSDP2 wraps returns a view (FSDP2 warns on every rank), the models' numbers unchanged;
* the cluster benchmark does not run, and reports with the reason, what the driver refuses (sparse under
  Adam), instead of failing as a whole;
* the demo's table (`make demo`) labels each number as it is computed (ratios, the column's API, the loss).

Everything here parses or builds in this process, except the tests marked ``multiprocess`` (torchrun).
"""
import ast
import json
import os
import subprocess

import pytest
import torch
from torch import nn

from lossless_hc.bench import cluster, cluster_report
from lossless_hc.bench.workloads import models, options, train
from processes import run_launcher

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = {"TORCHELASTIC_RUN_ID": "none", "RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
HOROVODRUN = {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "0"}
MPIRUN = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    """This process as a plain one, whatever started pytest: the launcher's variables pick defaults here."""
    for var in (*TORCHRUN, *HOROVODRUN, *MPIRUN, "PMI_RANK", "PMIX_RANK"):
        monkeypatch.delenv(var, raising=False)


def refused(argv, capsys, env=None) -> str:
    """The one line that parse_args prints for ``argv`` (asserting it refuses with status 2 and no more)."""
    with pytest.raises(SystemExit) as exc:
        train.parse_args(argv) if env is None else train.parse_args(argv, env=env)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: " in err and "Traceback" not in err, err
    assert isinstance(exc.value, options.UsageError) and exc.value.message in err
    return err


# -- 1. the launcher and the framework -----------------------------------------------------------------
@pytest.mark.parametrize("env, framework", [({}, "horovod"), (TORCHRUN, "ddp"), (HOROVODRUN, "horovod"),
                                            (MPIRUN, "horovod"),
                                            ({k: TORCHRUN[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                                       "MASTER_PORT")}, "ddp")])
def test_the_default_framework_is_the_launchers(env, framework):
    """torchrun without --framework trains DDP: before, every rank ran a 1-rank Horovod job and exited 0."""
    args = train.parse_args(["--compression", "none"], env=env)
    assert args.framework == framework and args.framework_by_default


@pytest.mark.parametrize("framework, env, script", [("horovod", TORCHRUN, "launch_horovod.sh"),
                                                    ("ddp", HOROVODRUN, "launch_torchrun.sh"),
                                                    ("fsdp", HOROVODRUN, "launch_torchrun.sh"),
                                                    ("ddp", MPIRUN, "launch_torchrun.sh")])
def test_a_framework_under_the_other_launcher_is_refused_naming_the_right_script(framework, env, script, capsys):
    err = refused(["--framework", framework, "--compression", "none"], capsys, env)
    assert f"--framework {framework}" in err and script in err


def test_local_runs_under_any_launcher_and_torchrun_wins_over_inherited_mpi_variables():
    for env in ({}, TORCHRUN, HOROVODRUN, MPIRUN):
        assert train.parse_args(["--framework", "local"], env=env).framework == "local"
    assert options.detect_launcher({**MPIRUN, **TORCHRUN})[0] == "torch"   # e.g. srun/mpirun around torchrun
    assert options.detect_launcher({"RANK": "0", "WORLD_SIZE": "2"}) == (None, None)   # the bench's local runs


def test_ddp_without_torch_distributed_variables_is_one_line_naming_torchrun():
    """Before: init_process_group's env:// traceback about RANK."""
    args = train.parse_args(["--framework", "ddp", "--compression", "none"])
    with pytest.raises(SystemExit, match="launch_torchrun.sh"):
        train.DDP(args)


# -- 2. option values ----------------------------------------------------------------------------------
BAD_VALUES = [
    (["--compression", "topk", "--topk-ratio", "0"], "--topk-ratio", "(0, 1]"),
    (["--topk-ratio", "1.5"], "--topk-ratio", "(0, 1]"),
    (["--topk-ratio", "nan"], "--topk-ratio", "finite"),
    (["--compression", "thc", "--thc-bits", "0"], "--thc-bits", "[1, 16]"),
    (["--thc-bits", "17"], "--thc-bits", "[1, 16]"),
    (["--max-density", "0"], "--max-density", "(0, 1]"),
    (["--max-density", "1.01"], "--max-density", "(0, 1]"),
    (["--steps", "0"], "--steps", "positive integer"),
    (["--steps", "-5"], "--steps", "positive integer"),
    (["--batch", "0"], "--batch", "positive integer"),            # before: trained on nothing, exit 0
    (["--log-every", "0"], "--log-every", "positive integer"),    # before: ZeroDivisionError
    (["--framework", "fsdp", "--compression", "none", "--shards", "-1"], "--shards", "positive integer"),
    (["--framework", "fsdp", "--compression", "none", "--shards", "0"], "--shards", "positive integer"),
    (["--framework", "ddp", "--compression", "none", "--shards", "2"], "--shards", "--framework fsdp"),
    (["--framework", "fsdp", "--compression", "none", "--sparse-embeddings"], "--sparse-embeddings", "dense"),
    (["--skew", "-1"], "--skew", ">= 0"),
]


@pytest.mark.parametrize("argv, option, allowed", BAD_VALUES, ids=[" ".join(a) for a, _, _ in BAD_VALUES])
def test_a_bad_value_is_one_line_naming_the_option_and_what_it_takes(argv, option, allowed, capsys):
    err = refused(argv, capsys)
    assert option in err and allowed in err


def test_shards_must_divide_the_world_size_that_torchrun_set(capsys):
    argv = ["--framework", "fsdp", "--compression", "none", "--shards", "3"]
    assert "must divide the world size 4" in refused(argv, capsys, TORCHRUN)
    assert train.parse_args(argv[:-1] + ["2"], env=TORCHRUN).shards == 2


@pytest.mark.parametrize("argv, env, fix", [
    (["--compression", "thc"], {}, "without --shards every rank is in one shard group"),
    (["--compression", "thc", "--shards", "4"], TORCHRUN, "4 ranks in shards of 4 leave one replica"),
    (["--compression", "thc", "--shards", "2", "--compress-reduce-scatter"], {}, "drop --compress-reduce-scatter")])
def test_fsdp_modes_of_the_replica_all_reduce_alone_are_refused_without_replicas(argv, env, fix, capsys):
    """thc compresses FSDP2's replica all-reduce only: with one replica (or asked for the reduce-scatter)
    the driver refuses at parsing (before: after the process group, on every rank). auto and
    auto-lossy fill the reduce-scatter with the exact sparse one (until 2026-12-02 refused as thc is)."""
    err = refused(["--framework", "fsdp", *argv], capsys, env)
    assert "compresses the replica all-reduce only" in err and fix in err, err
    for ok in (["--compression", "thc", "--shards", "2"], ["--compression", "lossless"], ["--compression", "auto"],
               ["--compression", "auto-lossy", "--shards", "2", "--compress-reduce-scatter"]):
        assert train.parse_args(["--framework", "fsdp", *ok], env=TORCHRUN).framework == "fsdp"


def test_the_values_the_library_accepts_parse():
    args = train.parse_args(["--compression", "thc", "--thc-bits", "1", "--topk-ratio", "1", "--max-density", "1",
                             "--steps", "1"])
    assert (args.thc_bits, args.topk_ratio, args.max_density, args.steps) == (1, 1.0, 1.0, 1)
    assert train.parse_args(["--thc-bits", "16"]).thc_bits == 16


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch sees a CUDA device")
def test_cuda_on_a_torch_without_it_is_refused_at_parsing(capsys):
    """Before: AttributeError from torch.cuda.set_device on every rank."""
    err = refused(["--device", "cuda"], capsys)
    assert "--device" in err and "--device cpu" in err


# -- 3. the launch scripts -------------------------------------------------------------------------------
@pytest.mark.parametrize("launcher", ["launch_horovod.sh", "launch_torchrun.sh", "launch_mpirun.sh"])
@pytest.mark.parametrize("np_", ["0", "-1", "two", "1.5"])
def test_a_launch_script_refuses_a_worker_count_that_is_not_positive(launcher, np_):
    """Before: horovodrun -np 0 exited 0 having run nothing; torchrun and mpirun: a traceback, a page."""
    res = subprocess.run(["bash", os.path.join(REPO, "scripts", launcher), np_, "scripts/train_ncf.py"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"NP must be a positive integer, got '{np_}'" in res.stderr and "usage:" in res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""


@pytest.mark.parametrize("role", ["scheduler", "server", "worker"])
def test_a_byteps_role_without_the_schedulers_port_is_refused(role):
    """A role of a multi-machine BytePS job (docs/BYTEPS.md) needs DMLC_PS_ROOT_PORT or --port: a random
    port of its own, different on every machine, would leave the job waiting until its timeout."""
    env = {k: v for k, v in os.environ.items() if k != "DMLC_PS_ROOT_PORT"}
    env.update(DMLC_PS_ROOT_URI="10.0.0.1", DMLC_NUM_WORKER="1", DMLC_NUM_SERVER="1", DMLC_WORKER_ID="0")
    script = os.path.join(REPO, "scripts", "launch_byteps.sh")
    res = subprocess.run(["bash", script, "--role", role, "--", "true"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and "DMLC_PS_ROOT_PORT" in res.stderr, res.stdout + res.stderr
    if role == "worker":   # given either way, the port reaches the worker's command
        for extra, port in (({"DMLC_PS_ROOT_PORT": "1234"}, []), ({}, ["--port", "1234"])):
            res = subprocess.run(["bash", script, *port, "--role", role, "--", "sh", "-c", "echo $DMLC_PS_ROOT_PORT"],
                                 cwd=REPO, env={**env, **extra}, capture_output=True, text=True, timeout=60)
            assert (res.returncode, res.stdout) == (0, "1234\n"), res.stdout + res.stderr


# -- 4, 5. the help and the docstrings ------------------------------------------------------------------
def test_help_lists_the_modes_of_each_framework(capsys):
    with pytest.raises(SystemExit) as exc:
        train.parse_args(["--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())   # unwrapped
    section = text[text.index("--compression MODE "):text.index("--steps STEPS ")]
    for framework, modes in train.SUPPORTED.items():
        listed = "all" if modes == train.COMPRESSIONS else ", ".join(modes)
        assert f"{framework}: {listed}" in section or f"{framework} and " in section, (framework, section)
    assert "ddp and local: all" in section
    assert "torchrun" in text[text.index("--framework {"):]   # the default framework's rule


@pytest.mark.parametrize("name", ["ncf", "lstm", "digits"])
def test_the_scripts_docstrings_point_to_help_and_name_every_framework(name):
    with open(os.path.join(REPO, "scripts", f"train_{name}.py")) as f:
        doc = ast.get_docstring(ast.parse(f.read()))
    assert "none|fp16|lossless|topk" not in doc and "horovod|ddp;" not in doc   # the old, partial lists
    assert "--help" in doc
    for framework in ("horovod", "ddp", "fsdp"):
        assert framework in doc


# -- 6. no view out of a module FSDP2 wraps, the same numbers ------------------------------------------
def small_models():
    tokens = torch.randint(0, 50, (3, 7))
    return {"ncf": (models.NCF(40, 30, dim=4), (torch.randint(0, 40, (5,)), torch.randint(0, 30, (5,)))),
            "lstm": (models.LSTMLanguageModel(50, dim=8, hidden=8), (tokens,)),
            "bert": (models.SmallBERT(vocab=50, dim=8, heads=2, layers=1, max_len=7), (tokens,)),
            "digits": (models.DigitsCNN(), (torch.randn(2, 1, 8, 8),))}


@pytest.mark.parametrize("name", ["ncf", "lstm", "bert", "digits"])
def test_no_module_that_fsdp_wraps_returns_a_view(name):
    """train.FSDP.wrap shards the root and every child with parameters; FSDP2 warns, on every rank, when
    one of them returns a view (a tensor with a ``_base``)."""
    model, inputs = small_models()[name]
    wrapped = [model] + [c for c in model.children() if any(p.requires_grad for p in c.parameters())]
    views = []

    def check(module, _inputs, output):
        outs = output if isinstance(output, tuple) else (output,)
        flat = [t for o in outs for t in (o if isinstance(o, tuple) else (o,))]
        views.extend(type(module).__name__ for t in flat if isinstance(t, torch.Tensor) and t._base is not None)
    for m in wrapped:
        m.register_forward_hook(check)
    model(*inputs)
    assert views == []


def test_the_view_free_models_compute_what_the_view_returning_ones_did():
    """Bit for bit: the sequence-first LSTM is what batch_first=True runs, the head over flattened states is
    the same addmm, and the NCF's clone is a copy (tests/.. runs of the driver compare whole trainings)."""
    torch.manual_seed(0)
    lm = models.LSTMLanguageModel(50, dim=8, hidden=8)
    tokens = torch.randint(0, 50, (3, 7))
    old = nn.LSTM(8, 8, num_layers=2, batch_first=True)
    old.load_state_dict(lm.lstm.state_dict())
    h, _ = old(lm.embed(tokens))
    assert torch.equal(lm(tokens), lm.decoder(h))
    bert = models.SmallBERT(vocab=50, dim=8, heads=2, layers=1, max_len=7)
    hidden = bert.encoder(bert.tokens(tokens) + bert.positions[:7])
    assert torch.equal(bert(tokens), bert.head(hidden).reshape(-1, 50))
    ncf = models.NCF(40, 30, dim=4)
    u, i = torch.randint(0, 40, (5,)), torch.randint(0, 30, (5,))
    cat = torch.cat([ncf.user_gmf(u) * ncf.item_gmf(i), ncf.mlp(torch.cat([ncf.user_mlp(u), ncf.item_mlp(i)], -1))], -1)
    assert torch.equal(ncf(u, i), ncf.out(cat).squeeze(-1))


# -- 7. the cluster benchmark skips what the driver refuses -------------------------------------------------
def test_the_cluster_bench_does_not_run_sparse_under_adam_and_says_why():
    runs, _ = cluster.plan(["horovod", "ddp"], ["sparse", "lossless"])
    for model in ("lstm", "bert"):   # Adam by default
        why = cluster.refusals(model, runs, 30, 5, [])
        assert set(why) == {("horovod", "sparse"), ("ddp", "sparse")}, why
        assert all("Adam" in w and "--optimizer sgd" in w for w in why.values())
    assert cluster.refusals("lstm", runs, 30, 5, ["--optimizer", "sgd"]) == {}
    assert cluster.refusals("ncf", runs, 30, 5, []) == {}   # SGD
    # fsdp in one shard group of every rank (--fsdp-mesh flat): thc has no replicas to compress (auto
    # sends the reduce-scatter's rows)
    runs, _ = cluster.plan(["fsdp"], ["lossless", "topk", "thc", "auto", "fp16"])
    assert set(cluster.refusals("ncf", runs, 30, 5, [], shards=1, hosts=2, fsdp_flat=True)) == {("fsdp", "thc")}
    assert cluster.refusals("ncf", runs, 30, 5, [], shards=2, hosts=2) == {}   # HSDP: 2 replicas
    assert set(cluster.refusals("ncf", runs, 30, 5, [], shards=2, hosts=1)) == {("fsdp", "thc")}
    md = cluster_report.render_markdown(
        {"rows": [], "compute_s": {}, "shaping": {}, "skipped": [],
         "refused": [["ddp", "sparse", "torch's Adam refuses sparse gradients"]]}, "t")
    assert "Not run (the training driver refuses the configuration): ddp sparse (torch's Adam refuses" in md


# -- under torchrun ----------------------------------------------------------------------------------------
def torchrun(tmp_path, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = run_launcher(["bash", os.path.join(REPO, "scripts", "launch_torchrun.sh"), "2",
                          os.path.join(REPO, "scripts", "train_ncf.py"), "--users", "300", "--items", "300",
                          "--dim", "4", "--batch", "32", "--steps", "2", "--log-every", "2",
                          "--json", str(tmp_path / "r{rank}.json"), *args],
                       cwd=REPO, env=env, timeout=240)
    return res, res.stdout + res.stderr


@pytest.mark.multiprocess
def test_torchrun_without_framework_trains_one_two_rank_ddp_job(tmp_path):
    res, out = torchrun(tmp_path, "--compression", "none")
    assert res.returncode == 0, out[-3000:]
    assert "ncf on 2 ddp worker(s) (--framework's default under torchrun)" in out
    reports = [json.load(open(tmp_path / f"r{r}.json")) for r in (0, 1)]
    assert [(r["framework"], r["workers"]) for r in reports] == [("ddp", 2)] * 2


@pytest.mark.multiprocess
def test_fsdp_under_torchrun_prints_no_view_warning_and_horovod_is_refused(tmp_path):
    res, out = torchrun(tmp_path, "--framework", "fsdp", "--compression", "none")
    assert res.returncode == 0, out[-3000:]
    assert "returned a view" not in out
    res, out = torchrun(tmp_path, "--framework", "horovod")
    # one line per rank that got to print it (torchrun stops the other ranks when the first one exits)
    assert res.returncode != 0 and "error: --framework horovod: this process was started by torchrun" in out
    assert "Traceback (most recent call last):\n  File \"" + os.path.join(REPO, "lossless_hc") not in out


@pytest.mark.parametrize("argv, message", [
    (["train", "--steps", "0"], "argument --steps: must be a positive integer"),   # it ran the default 150 steps
    (["train", "--workers", "-1"], "argument --workers: must be a positive integer"),
    (["simulate", "--users", "0"], "argument --users: must be a positive integer"),
    (["simulate", "--dim", "0"], "argument --dim: must be a positive integer"),
    (["simulate", "--batch", "0"], "argument --batch: must be a positive integer"),   # it printed empty tables
    (["simulate", "--skews", "nan"], "--skews finite and >= 0"),
    (["plan", "--strategies", ""], "--strategies names none"),
])
def test_the_bench_refuses_values_it_would_misread_in_one_line(argv, message, capsys):
    from lossless_hc.bench.cli import main
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code not in (0, None)
    captured = capsys.readouterr()
    assert message in captured.err + (code if isinstance(code, str) else "")


# -- 7. the demo's table (`make demo`), from two runs' results --------------------------------------------
@pytest.mark.parametrize("framework, base_ms, ours_ms, speed, column", [
    ("horovod", 60.0, 30.0, "30.0 ms (2.00x faster)", "Compression.lossless"),
    ("ddp", 50.0, 100.0, "100.0 ms (2.00x slower)", "lossless_hook"),
])
def test_the_demo_table_says_what_each_number_is(framework, base_ms, ours_ms, speed, column, monkeypatch, capsys):
    from lossless_hc.bench.workloads import demo

    def result(compression, ms, sent, params):
        return {"bytes_per_step": sent, "step_ms_median": ms, "metric": "hit_rate@10", "value": 0.5,
                "final_loss": 0.25, "fallbacks": 2 if compression == "lossless" else 0, "params": params}
    runs = {"none": result("none", base_ms, 4 * 2 ** 20, {"w": torch.tensor([1.0, -3.0]), "b": torch.tensor([2.0])}),
            "lossless": result("lossless", ours_ms, 2 ** 20, {"w": torch.tensor([1.0, -3.0 + 2 ** -20]),
                                                             "b": torch.tensor([2.0 - 2 ** -10])})}
    monkeypatch.setattr(demo, "run", lambda fw, model, workers, compression, steps, tmp: runs[compression])
    assert demo.main(["--framework", framework, "--steps", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if "uncompressed" in line)
    assert lines[header].split()[-1] == column
    table = dict((line[:line.index("  ")], line) for line in lines[header + 1:header + 6])
    assert table["bytes sent per step (one rank)"].endswith("4.00 MiB  1.00 MiB (0.250x)")
    assert table["median step time"].endswith(speed)
    assert "training loss (mean of the last 10 steps)" in table
    assert f"between the two runs: {2 ** -10:.3g} (largest parameter 3)" in "\n".join(lines)
