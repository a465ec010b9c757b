"""Configuration: YAML + dotlist overrides, and one clear error per kind of bad input."""

from __future__ import annotations

from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import pytest

from oobleck_elastic.config import ConfigError, JobConfig, from_dict, load_config, to_dict

CONFIGS = sorted(Path(__file__).resolve().parents[2].joinpath("configs").glob("*.yaml"))

SCHEDULE_NAMES = "1f1b, gpipe, interleaved-1f1b, zero-bubble, zbv, auto"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, JobConfig)
    assert from_dict(to_dict(cfg)) == cfg


def test_at_least_the_promised_configs_ship() -> None:
    assert {p.stem for p in CONFIGS} >= {"gpt2-tiny", "gpt2-small", "llama-tiny", "gpt3-175b"}


def test_dotlist_overrides_are_typed() -> None:
    cfg = load_config(CONFIGS[0], ["training.steps=10", "training.optimizer.lr=2e-3", "fault_tolerance.f=2"])
    assert cfg.training.steps == 10 and cfg.training.optimizer.lr == 2e-3 and cfg.fault_tolerance.f == 2


def test_every_field_has_a_docstring() -> None:
    import ast
    import inspect

    import oobleck_elastic.config as config

    documented = set()
    modules = sorted(Path(inspect.getfile(config)).parent.glob("*.py"))  # the sections, one module per group
    classes = [n for m in modules for n in ast.parse(m.read_text()).body if isinstance(n, ast.ClassDef)]
    for cls in classes:
        body = cls.body
        for a, b in zip(body, body[1:]):
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                documented.add((cls.name, a.target.id))  # type: ignore[union-attr]

    def walk(dc):
        for f in fields(dc):
            assert (dc.__name__, f.name) in documented, f"{dc.__name__}.{f.name} has no docstring"
            default = f.default_factory() if f.default_factory is not MISSING else None  # type: ignore[misc]
            if is_dataclass(default):
                walk(type(default))

    walk(JobConfig)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["training.stepz=3"], "<defaults>: unknown key 'training.stepz': did you mean 'training.steps'?"),
        (
            ["training.steps=many"],
            "<defaults>: bad value for 'training.steps': Value 'many' of type 'str' could not be converted to Integer",
        ),
        (
            ["training.global_batch_size=10", "training.microbatch_size=4"],
            "<defaults>: 'training.global_batch_size' (10) must be a multiple of 'training.microbatch_size' (4): "
            "change one of them, e.g. training.global_batch_size=12",
        ),
        (
            ["fault_tolerance.f=-1"],
            "<defaults>: 'fault_tolerance.f' must be >= 0 (got -1): it is the number of "
            "simultaneous node failures to survive",
        ),
        (
            ["planning.schedule=zigzag"],
            "<defaults>: 'planning.schedule' is 'zigzag'; choose one of " + SCHEDULE_NAMES,
        ),
        (
            ["data.seq_len=128"],
            "<defaults>: 'data.seq_len' (128) exceeds 'model.max_seq_len' (64): lower "
            "data.seq_len or raise model.max_seq_len",
        ),
        (["training.steps"], "override 'training.steps' is not of the form key=value (e.g. training.steps=10)"),
    ],
)
def test_bad_input_gets_one_clear_error(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value) == message


def test_unknown_key_in_yaml_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  hiden_size: 32\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    assert str(err.value) == f"{bad}: unknown key 'model.hiden_size': did you mean 'model.hidden_size'?"


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="config file 'nope.yaml' does not exist"):
        load_config("nope.yaml")


def test_a_malformed_yaml_file_is_one_error_naming_the_file_and_line(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("training:\n  steps: 10\n  microbatch_size: [2\nmodel: {}\n")
    with pytest.raises(ConfigError, match=r"config file '.*bad.yaml' is not valid YAML at line \d+, column \d+"):
        load_config(bad)


# --------------------------------------------------------------------- choices (Literal-typed fields)
CHOICES = {
    "model.family": ("gpt2", "llama", "mistral", "qwen2", "custom"),
    "model.attn_implementation": ("sdpa", "eager"),
    "data.source": ("stdlib", "files", "jsonl", "parquet", "hf_disk", "tokens"),
    "data.tokenizer": ("bytes", "bpe", "hf"),
    "data.token_dtype": ("uint16", "uint32"),
    "training.optimizer.name": ("adamw", "sgd"),
    "training.lr_schedule.decay": ("constant", "linear", "cosine"),
    "training.precision": ("fp32", "bf16"),
    "training.device": ("auto", "cpu", "cuda"),
    "planning.schedule": ("1f1b", "gpipe", "interleaved-1f1b", "zero-bubble", "zbv", "auto"),
    "logging.level": ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
}


@pytest.mark.parametrize("key", CHOICES)
def test_a_choice_field_is_typed_and_refuses_other_values(key: str) -> None:
    kind: Any = JobConfig
    for part in key.split("."):
        kind = get_type_hints(kind)[part]
    assert get_origin(kind) is Literal and get_args(kind) == CHOICES[key]
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}=nope"])
    assert str(err.value) == f"<defaults>: '{key}' is 'nope'; choose one of {', '.join(CHOICES[key])}"
    value = CHOICES[key][1]
    cfg = load_config(None, [f"{key}={value}"] + (["data.paths=[x]"] if key == "data.source" else []))
    got = cfg
    for part in key.split("."):
        got = getattr(got, part)
    assert got == value and type(got) is str  # a plain string, as in YAML and to_dict


def test_every_bad_choice_and_broken_rule_is_one_clause_of_one_error() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(
            None, ["planning.schedule=zigzag", "training.device=tpu", "data.tokenizer=hff", "data.tokenizer_path=t"]
        )
    assert str(err.value) == (
        "<defaults>: 'planning.schedule' is 'zigzag'; choose one of " + SCHEDULE_NAMES + "; "
        "'training.device' is 'tpu'; choose one of auto, cpu, cuda; "
        "'data.tokenizer' is 'hff'; choose one of bytes, bpe, hf; "
        # the rules see the values as given
        "'data.tokenizer_path' is set but 'data.tokenizer' is hff: set data.tokenizer=hf to use it"
    )


def test_an_override_fixes_a_choice_the_file_got_wrong(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("planning:\n  schedule: zigzag\n")
    with pytest.raises(
        ConfigError,
        match="'planning.schedule' is 'zigzag'; choose one of " + SCHEDULE_NAMES,
    ):
        load_config(path)
    assert load_config(path, ["planning.schedule=gpipe"]).planning.schedule == "gpipe"


def test_from_dict_refuses_a_bad_choice_with_the_same_words() -> None:
    data = to_dict(load_config(None))
    data["training"]["precision"] = "fp16"
    with pytest.raises(ConfigError) as err:
        from_dict(data)
    assert str(err.value) == "<config>: 'training.precision' is 'fp16'; choose one of fp32, bf16"


def test_a_file_that_is_not_a_mapping_is_one_error(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- model\n")
    with pytest.raises(ConfigError, match="config file '.*list.yaml' is not a mapping of sections"):
        load_config(path)


# --------------------------------------------------------------------- the package
def test_the_config_package_imports_one_way() -> None:
    """schema imports nothing of the package, the others only modules before them: no cycle, hidden
    (a function-local import) or not; and the old rules module is gone."""
    import ast

    package = Path(__file__).resolve().parents[2] / "oobleck_elastic" / "config"
    imports: dict[str, set[str]] = {}
    for module in package.glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names |= {node.module} if node.module else {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.startswith("oobleck_elastic.config."):
                    names.add(node.module.rpartition(".")[2])
        imports[module.stem] = names
    assert imports["schema"] == set(), imports["schema"]
    done: list[str] = []
    while len(done) < len(imports):  # a topological order exists: no cycle
        ready = [m for m in imports if m not in done and imports[m] <= set(done)]
        assert ready, f"import cycle among {sorted(set(imports) - set(done))}: {imports}"
        done += ready
    sources = package.parent.rglob("*.py")
    assert not [p for p in sources if "config_rules" in p.read_text()], "config_rules.py is gone; import config"


# --------------------------------------------------------------------- each section's rules, on made-up sections
def test_each_section_checks_its_own_rules() -> None:
    from oobleck_elastic.config import (
        CheckpointConfig,
        DataConfig,
        FaultToleranceConfig,
        LoggingConfig,
        LRScheduleConfig,
        ModelConfig,
        OptimizerConfig,
        PlanningConfig,
        TrainingConfig,
    )

    for section in (ModelConfig, DataConfig, TrainingConfig, FaultToleranceConfig, PlanningConfig, CheckpointConfig):
        assert section().validate() == [], section.__name__
    assert OptimizerConfig().validate() == LoggingConfig().validate() == []
    assert ModelConfig(hidden_size=65, num_heads=4, num_kv_heads=3, family="custom").validate() == [
        "'model.hidden_size' (65) must be a multiple of 'model.num_heads' (4)",
        "'model.num_heads' (4) must be a multiple of 'model.num_kv_heads' (3)",
        "'model.family' is custom but 'model.custom_factory' is not set (give module:function returning a "
        "list[nn.Module])",
    ]
    assert ModelConfig(vocab_size=0, num_heads=0).validate() == [
        "'model.vocab_size' must be >= 1 (got 0)",
        "'model.num_heads' must be >= 1 (got 0)",
    ]
    assert DataConfig(source="tokens", tokenizer="hf").validate() == [
        "'data.source' is tokens but 'data.paths' is empty"
    ]
    assert DataConfig(source="files", paths=["a"], tokenizer="hf").validate() == [
        "'data.tokenizer' is hf but 'data.tokenizer_path' is not set: give the directory of a tokenizer saved "
        "with save_pretrained"
    ]
    # a section holding sections checks them too, with their full keys
    training = TrainingConfig(steps=-1, lr_schedule=LRScheduleConfig(warmup_steps=-2), microbatch_size="big")
    assert training.validate() == [
        "'training.lr_schedule.warmup_steps' must be >= 0 (got -2)",
        "'training.steps' must be >= 0 (got -1)",
        "'training.microbatch_size' is 'big': give a number >= 1 or auto",
    ]
    assert TrainingConfig(microbatch_size="auto", global_batch_size=10).validate() == []
    assert FaultToleranceConfig(f=-1, preempt_signals=["SIGKILL"], watch_interval_s=0).validate() == [
        "'fault_tolerance.f' must be >= 0 (got -1): it is the number of simultaneous node failures to survive",
        "'fault_tolerance.preempt_signals': 'SIGKILL' cannot be a preemption notice; give signal names such as "
        "SIGTERM or SIGUSR1 (not SIGINT, SIGKILL or SIGSTOP)",
        "'fault_tolerance.watch_interval_s' must be > 0 (got 0)",
    ]
    assert PlanningConfig(gpus_per_node=4, tensor_parallel="auto", profile_path="p{tp}.json").validate() == []
    assert PlanningConfig(memory_margin=1.0, max_nodes=0).validate() == [
        "'planning.memory_margin' must be in [0, 1) (got 1.0)",
        "'planning.max_nodes' must be >= 1 (got 0)",
    ]
    assert CheckpointConfig(interval_steps=-1).validate() == ["'checkpoint.interval_steps' must be >= 0 (got -1)"]
    assert OptimizerConfig(lr=-1e-3, betas=[0.9, 1.0], grad_clip=-1).validate() == [
        "'training.optimizer.lr' must be > 0 (got -0.001)",
        "'training.optimizer.grad_clip' must be >= 0 (got -1)",
        "'training.optimizer.betas' must be two numbers in [0, 1) (got [0.9, 1.0])",
    ]
    assert TrainingConfig(optimizer=OptimizerConfig(lr=0.0)).validate() == [
        "'training.optimizer.lr' must be > 0 (got 0.0)"
    ]


def test_the_job_gathers_its_sections_then_checks_across_them() -> None:
    from oobleck_elastic.config import CheckpointConfig, DataConfig, ModelConfig

    job = JobConfig(
        model=ModelConfig(max_seq_len=32), data=DataConfig(seq_len=64), checkpoint=CheckpointConfig(interval_steps=-1)
    )
    assert job.validate() == [
        "'checkpoint.interval_steps' must be >= 0 (got -1)",
        "'data.seq_len' (64) exceeds 'model.max_seq_len' (32): lower data.seq_len or raise model.max_seq_len",
    ]
    assert JobConfig().validate() == []


def test_relative_paths_of_a_file_are_relative_to_its_folder(tmp_path: Path, monkeypatch) -> None:
    """Paths written in a config file resolve against the file's folder, from any working
    directory; overrides and defaults stay relative to the working directory; `~` is expanded."""
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "job.yaml").write_text(
        "data:\n"
        "  source: jsonl\n"
        "  paths: [corpus.jsonl, ../shared/more, /abs/elsewhere]\n"
        "  tokenizer: hf\n"
        "  tokenizer_path: tok.json\n"
        "  cache_dir: ~/oobleck-cache\n"
        "planning: {profile_path: 'profiles/p-tp{tp}.json'}\n"
        "checkpoint: {dir: ckpt}\n"
        "logging: {events_dir: ''}\n"
    )
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = load_config("../job/job.yaml", ["logging.tensorboard_dir=tb"])
    assert cfg.data.paths == [str(folder / "corpus.jsonl"), str(tmp_path / "shared" / "more"), "/abs/elsewhere"]
    assert cfg.data.tokenizer_path == str(folder / "tok.json")
    assert cfg.data.cache_dir == str(tmp_path / "home" / "oobleck-cache")
    assert cfg.planning.profile_path == str(folder / "profiles" / "p-tp{tp}.json")
    assert cfg.checkpoint.dir == str(folder / "ckpt")
    assert cfg.logging.events_dir == ""  # empty = off, not the folder
    assert cfg.logging.tensorboard_dir == "tb"  # an override: relative to the working directory
    assert load_config(None).checkpoint.dir == "checkpoints/oobleck"  # defaults too
    over = load_config(folder / "job.yaml", ["data.paths=[mine.jsonl]", "data.tokenizer_path=t.json"])
    assert over.data.paths == ["mine.jsonl"] and over.data.tokenizer_path == "t.json"
    assert from_dict(to_dict(cfg)) == cfg  # resolved once: the dict form (checkpoints, workers) keeps them


def test_each_job_has_a_checkpoint_directory_of_its_own(tmp_path: Path, monkeypatch) -> None:
    """An empty checkpoint.dir (the default) is `checkpoints/<job>`, relative to the working
    directory: <job> is `name` when the file or an override sets it, else the file's stem. A
    directory the config gives is kept."""
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)
    assert load_config(root / "configs/gpt2-tiny.yaml").checkpoint.dir == "checkpoints/gpt2-tiny"
    assert load_config(root / "configs/cpu-own-data.yaml").checkpoint.dir == "checkpoints/cpu-own-data"
    assert load_config(root / "configs/gpt2-tiny.yaml", ["name=my run/2"]).checkpoint.dir == "checkpoints/my-run-2"
    (tmp_path / "nameless.yaml").write_text("training: {steps: 3}\n")
    nameless = load_config(tmp_path / "nameless.yaml")
    assert (nameless.name, nameless.checkpoint.dir) == ("oobleck", "checkpoints/nameless")
    assert load_config(tmp_path / "nameless.yaml", ["name=x"]).checkpoint.dir == "checkpoints/x"
    (tmp_path / "empty.yaml").write_text("checkpoint: {dir: ''}\n")
    assert load_config(tmp_path / "empty.yaml").checkpoint.dir == "checkpoints/empty"  # empty = the default
    (tmp_path / "given.yaml").write_text("checkpoint: {dir: ck}\n")
    assert load_config(tmp_path / "given.yaml").checkpoint.dir == str(tmp_path / "ck")
    assert load_config(root / "configs/gpt2-tiny.yaml", ["checkpoint.dir=mine"]).checkpoint.dir == "mine"
    assert JobConfig().checkpoint.dir == "checkpoints/oobleck" and JobConfig(name="j").checkpoint.dir == "checkpoints/j"
    assert from_dict(to_dict(nameless)) == nameless  # resolved once: workers given the dict keep it
