"""Bad input — config, data, model and HTTP requests — gives one clear error that names the
offending field (and the fix), raised before any expensive work; nothing already written is
touched, and a server that refused a request keeps serving.

Every case asserts the dotted field name is in the message (config: ``ConfigError.field`` as
well). Counted cases: 45 config, 6 data, 3 model, 12 request, 1 connection; plus 6 whole-process
cases: a bad value on the command line is one line on stderr and exit status 2 (python, torchrun)."""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from arealite.api.cli import ConfigError, check_model_fits, load_config, validate_config
from arealite.api.config import (DatasetConfig, DPOConfig, GenerationConfig, GRPOConfig, InferenceEngineConfig,
                                 MultiTurnGRPOConfig, PPOConfig, SFTConfig, ToolAgentGRPOConfig)
from arealite.dataset.math_data import load_dataset
from arealite.utils.proc import free_port

# ---------------------------------------------------------------------------------------------
# Config: YAML (types and ranges), command line, cross-field rules
# ---------------------------------------------------------------------------------------------
YAML_CASES = [
    # (config class, YAML text, field the message must name, a word of the fix/reason)
    (GRPOConfig, "unknown_top: 1", "unknown_top", "unknown config key"),
    (GRPOConfig, "actor:\n  optimiser: {}", "actor.optimiser", "valid keys"),
    (GRPOConfig, "gconfig:\n  n_samples: eight", "gconfig.n_samples", "integer"),
    (GRPOConfig, "gconfig:\n  n_samples: 2.5", "gconfig.n_samples", "integer"),
    (GRPOConfig, "actor:\n  optimizer:\n    lr: fast", "actor.optimizer.lr", "number"),
    (GRPOConfig, "actor:\n  mb_spec:\n    packing: 3", "actor.mb_spec.packing", "true or false"),
    (GRPOConfig, "actor: 5", "actor", "mapping"),
    (GRPOConfig, "actor:\n  dtype: float16", "actor.dtype", "float32"),
    (GRPOConfig, "gconfig:\n  stop_token_ids: 2", "gconfig.stop_token_ids", "list"),
    (GRPOConfig, "gconfig:\n  stop_token_ids: [2, x]", "gconfig.stop_token_ids[1]", "integer"),
    (GRPOConfig, "gconfig:\n  stop_token_ids: [-3]", "gconfig.stop_token_ids[0]", ">= 0"),
    (GRPOConfig, "experiment_name: 7", "experiment_name", "string"),
    (GRPOConfig, "gconfig:\n  n_samples: 0", "gconfig.n_samples", ">= 1"),
    (GRPOConfig, "gconfig:\n  max_new_tokens: -1", "gconfig.max_new_tokens", ">= 1"),
    (GRPOConfig, "gconfig:\n  temperature: 0.0", "gconfig.temperature", "greedy"),
    (GRPOConfig, "gconfig:\n  top_p: 1.5", "gconfig.top_p", "<= 1"),
    (GRPOConfig, "gconfig:\n  top_p: 0.9", "gconfig.top_p", "importance weights"),
    (GRPOConfig, "gconfig:\n  top_k: 50", "gconfig.top_k", "importance weights"),
    (GRPOConfig, "gconfig:\n  top_k: -5", "gconfig.top_k", "-1 disables"),
    (GRPOConfig, "actor:\n  optimizer:\n    lr: -1.0e-5", "actor.optimizer.lr", "> 0"),
    (GRPOConfig, "actor:\n  optimizer:\n    beta2: 1.0", "actor.optimizer.beta2", "< 1"),
    (GRPOConfig, "actor:\n  optimizer:\n    warmup_steps: -2", "actor.optimizer.warmup_steps", ">= 0"),
    (GRPOConfig, "actor:\n  mb_spec:\n    max_tokens_per_mb: 0", "actor.mb_spec.max_tokens_per_mb", ">= 1"),
    (GRPOConfig, "total_train_steps: 0", "total_train_steps", ">= 1"),
    (GRPOConfig, "train_dataset:\n  batch_size: 0", "train_dataset.batch_size", ">= 1"),
    (GRPOConfig, "train_dataset:\n  size: 0", "train_dataset.size", ">= 1"),
    (GRPOConfig, "train_dataset:\n  path: /nonexistent/gsm8k.jsonl", "train_dataset.path", "does not exist"),
    (GRPOConfig, "valid_dataset:\n  path: data.csv", "valid_dataset.path", ".jsonl"),
    (GRPOConfig, "rollout:\n  consumer_batch_size: 0", "rollout.consumer_batch_size", ">= 1"),
    (GRPOConfig, "rollout:\n  max_head_offpolicyness: -1", "rollout.max_head_offpolicyness", ">= 0"),
    (GRPOConfig, "rollout:\n  request_timeout: 0", "rollout.request_timeout", "> 0"),
    (GRPOConfig, "rollout:\n  addresses: [localhost]", "rollout.addresses[0]", "host:port"),
    (GRPOConfig, "rollout:\n  addresses: ['127.0.0.1:99999']", "rollout.addresses[0]", "host:port"),
    (GRPOConfig, "rollout:\n  n_servers: 0", "rollout.n_servers", ">= 1"),
    (GRPOConfig, "algo:\n  eps_clip: 0", "algo.eps_clip", "> 0"),
    (GRPOConfig, "algo:\n  kl_coef: -0.1", "algo.kl_coef", ">= 0"),
    (GRPOConfig, "algo:\n  adv_std_floor: -1.0", "algo.adv_std_floor", ">= 0"),
    (GRPOConfig, "recover:\n  keep_last: 0", "recover.keep_last", ">= 1"),
    (GRPOConfig, "actor:\n  path: /nonexistent/model", "actor.path", "does not exist"),
    (GRPOConfig, "experiment_name: a/b", "experiment_name", "without '/'"),
    (PPOConfig, "algo:\n  lam: 1.5", "algo.lam", "<= 1"),
    (DPOConfig, "algo:\n  beta: 0", "algo.beta", "> 0"),
    (SFTConfig, "train_dataset:\n  max_length: 1", "train_dataset.max_length", ">= 2"),
    (ToolAgentGRPOConfig, "sandbox:\n  memory_mb: 10", "sandbox.memory_mb", "64 MiB"),
    (MultiTurnGRPOConfig, "agent:\n  max_context_tokens: 10", "agent.max_context_tokens", "max_new_tokens"),
]


@pytest.mark.parametrize("cls,text,field,reason", YAML_CASES, ids=[c[2] + "-" + c[1][-14:] for c in YAML_CASES])
def test_bad_yaml_value_names_the_field(tmp_path, cls, text, field, reason):
    path = tmp_path / "c.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(cls, ["--config", str(path)])
    assert info.value.field == field and str(info.value).startswith(field + ":"), str(info.value)
    assert reason in str(info.value), str(info.value)


def test_yaml_float_without_a_dot_is_read_as_a_number(tmp_path):
    # YAML 1.1 reads 1e-5 as the string "1e-5"; a float field accepts it (a word is still an error above)
    path = tmp_path / "c.yaml"
    path.write_text("actor:\n  optimizer:\n    lr: 1e-5\n")
    assert load_config(GRPOConfig, ["--config", str(path)]).actor.optimizer.lr == 1e-5


@pytest.mark.parametrize("argv,field", [
    (["--rollout.max_head_offpolicyness", "-2"], "rollout.max_head_offpolicyness"),
    (["--gconfig.top_k", "20"], "gconfig.top_k"),
    (["--actor.optimizer.gradient_clipping", "-1"], "actor.optimizer.gradient_clipping"),
])
def test_bad_command_line_value_names_the_field(argv, field):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        load_config(GRPOConfig, argv)


def _run_recipe(launcher: list[str], argv: list[str]) -> subprocess.CompletedProcess:
    from conftest import REPO_ROOT, env_without_dist

    return subprocess.run([*launcher, os.path.join(REPO_ROOT, "recipes", "grpo_math.py"), *argv], cwd=REPO_ROOT,
                          env=env_without_dist(), capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv,field,fix", [
    (["--actor.optimizer.lr", "-1"], "actor.optimizer.lr", "must be > 0"),
    (["--gconfig.n_samples", "1"], "gconfig.n_samples", "--gconfig.n_samples 2"),
    (["--algo.overlong_penalty", "64", "--gconfig.max_new_tokens", "16"], "algo.overlong_penalty", "max_new_tokens=16"),
    (["--algo.loss_agg_mode", "sum"], "algo.loss_agg_mode", "choose one of"),
    (["--config", "no/such.yaml"], "--config", "file not found"),
])
def test_bad_value_on_the_command_line_is_one_line_and_exit_status_2(argv, field, fix):
    """``python recipes/grpo_math.py BAD``: exit 2 (as for an unknown flag) and stderr is exactly one
    line naming the field and the fix (no traceback), before anything is launched."""
    proc = _run_recipe([sys.executable], argv)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith(f"grpo_math.py: error: {field}"), proc.stderr
    assert fix in lines[0] and proc.stdout == ""


def test_bad_value_under_torchrun_is_one_line_from_the_worker_and_named_in_torchruns_report():
    """Under torchrun the worker prints the one line and exits 2; torchrun's elastic agent then
    prints its own failure report (it cannot be silenced from the worker) whose root cause is the
    same message (the worker writes it to $TORCHELASTIC_ERROR_FILE), and no line of the worker's
    traceback appears."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip(f"no torchrun beside {sys.executable}")
    proc = _run_recipe([torchrun, "--nproc_per_node=1"], ["--actor.optimizer.lr", "-1"])
    ours = [line for line in proc.stderr.splitlines() if "actor.optimizer.lr" in line]
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr, proc.stderr
    assert ours[0] == "grpo_math.py: error: actor.optimizer.lr: must be > 0, got -1.0; e.g. 1e-5", proc.stderr
    assert ours[1:] == ["  traceback : actor.optimizer.lr: must be > 0, got -1.0; e.g. 1e-5"], proc.stderr
    from conftest import REPO_ROOT

    assert os.path.join(REPO_ROOT, "arealite") not in proc.stderr  # no frame of our code


def test_batch_not_divisible_by_ranks_names_the_field():
    with pytest.raises(ConfigError, match=r"^train_dataset\.batch_size: 6 is not divisible by the 4 trainer ranks"):
        validate_config(GRPOConfig(train_dataset=DatasetConfig(batch_size=6)), world_size=4)
    cfg = GRPOConfig(train_dataset=DatasetConfig(batch_size=8), rollout=InferenceEngineConfig(consumer_batch_size=6))
    with pytest.raises(ConfigError, match=r"^rollout\.consumer_batch_size: 6 is not divisible by the 4"):
        validate_config(cfg, world_size=4)
    validate_config(GRPOConfig(), world_size=4)  # the defaults (8, 8) split over 4 ranks


def test_truncated_sampling_is_refused_for_rl_only():
    validate_config(DPOConfig(gconfig=GenerationConfig(top_p=0.9)))  # DPO trains on no behaviour logprobs
    with pytest.raises(ConfigError, match="^gconfig.top_p"):
        validate_config(PPOConfig(gconfig=GenerationConfig(top_p=0.9)))


def test_shipped_configs_pass_validation(monkeypatch):
    """Every shipped config validates in a fresh clone (the GSM8K ones name the hub set, which is
    only read, never checked online, here)."""
    from conftest import REPO_ROOT

    monkeypatch.chdir(REPO_ROOT)  # the configs' relative paths are relative to the repository root
    root = os.path.join(REPO_ROOT, "recipes", "configs")
    classes = {"dpo": DPOConfig, "grpo": GRPOConfig, "gspo": GRPOConfig, "multi": MultiTurnGRPOConfig,
               "ppo": PPOConfig, "sft": SFTConfig, "tool": ToolAgentGRPOConfig}
    from arealite.api.config import CodeGRPOConfig, GSPOConfig, ProxyAgentGRPOConfig, SearchAgentConfig, ServiceAgentConfig

    classes.update(gspo=GSPOConfig, multiply=ProxyAgentGRPOConfig, proxy=ProxyAgentGRPOConfig, code=CodeGRPOConfig,
                   search=SearchAgentConfig, service=ServiceAgentConfig)
    for name in sorted(os.listdir(root)):
        load_config(classes[name.split("_")[0]], ["--config", os.path.join(root, name)])


# ---------------------------------------------------------------------------------------------
# Data files
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("content,match", [
    ("", "file has no rows"),
    ("\n\n", "file has no rows"),
    ('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?", "answer": \n', r"row 2 is not valid JSON"),
    ('{"question": "1+1?", "answer": "#### 2"}\n[1, 2]\n', r"row 2 is a list, not a JSON object"),
    ('{"question": "1+1?"}\n', r"row 1 is missing field 'answer'"),
    ('{"question": "1+1?", "answer": "2"}\n', r"row 1 .*'####'"),
])
def test_bad_dataset_file_names_the_file_and_row(tmp_path, content, match):
    path = tmp_path / "train.jsonl"
    path.write_text(content)
    before = path.read_bytes()
    with pytest.raises(ValueError, match=match) as info:
        load_dataset(str(path), "train")
    assert str(path) in str(info.value)
    assert path.read_bytes() == before  # nothing written


# ---------------------------------------------------------------------------------------------
# Model folder: chat template, context length
# ---------------------------------------------------------------------------------------------
def test_model_without_chat_template_names_actor_path(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    check_model_fits(tiny_model_dir, GenerationConfig(), tok)  # the real template passes
    tok.chat_template = None
    with pytest.raises(ConfigError, match="^actor.path: .*no chat template"):
        check_model_fits(tiny_model_dir, GenerationConfig(), tok)


def test_max_new_tokens_beyond_the_model_context_names_the_field(tiny_model_dir):
    # the tiny model has max_position_embeddings=1024
    check_model_fits(tiny_model_dir, GenerationConfig(max_new_tokens=1000), prompt_tokens=24)
    with pytest.raises(ConfigError, match=r"^gconfig.max_new_tokens: 1000 \(\+ 25 prompt tokens\) exceeds .*=1024; "
                                          r"use at most 999"):
        check_model_fits(tiny_model_dir, GenerationConfig(max_new_tokens=1000), prompt_tokens=25)


def test_agent_context_beyond_the_model_context_names_the_field(tiny_model_dir):
    """A multi-turn episode may grow to agent.max_context_tokens: more than the model's positions is
    refused before any rollout (the server would refuse the long turns one by one)."""
    from arealite.api.config import MultiTurnConfig

    check_model_fits(tiny_model_dir, GenerationConfig(), agent=MultiTurnConfig(max_context_tokens=1024))
    with pytest.raises(ConfigError, match=r"^agent.max_context_tokens: 2048 exceeds the model's "
                                          r"max_position_embeddings=1024.*use at most 1024"):
        check_model_fits(tiny_model_dir, GenerationConfig(), agent=MultiTurnConfig(max_context_tokens=2048))


def test_model_folder_without_readable_config_names_actor_path(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="^actor.path: cannot read"):
        check_model_fits(str(tmp_path), GenerationConfig())


# ---------------------------------------------------------------------------------------------
# HTTP requests to `python -m arealite.server`
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("srv") / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "arealite.server", "--model-path", tiny_model_dir,
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    addr = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"http://{addr}/health", timeout=2).read()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"server did not start; see {log.name}")
            time.sleep(0.5)
    yield addr
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


def _post(addr: str, data: bytes, endpoint: str = "/generate") -> tuple[int, dict | str]:
    req = urllib.request.Request(f"http://{addr}{endpoint}", data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        body = e.read().decode(errors="replace")
        try:
            return e.code, json.loads(body)
        except ValueError:
            return e.code, body


GOOD = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
REQUEST_CASES = [
    # (raw body, field named in the reply)
    (b"{not json", "body"),
    (b"[1, 2, 3]", "body"),
    (json.dumps({"sampling_params": {}}).encode(), "input_ids"),
    (json.dumps({"input_ids": []}).encode(), "input_ids"),
    (json.dumps({"input_ids": [1, "two"]}).encode(), "input_ids"),
    (json.dumps({"input_ids": [1, 10**9]}).encode(), "input_ids"),
    (json.dumps({**GOOD, "sampling_params": "fast"}).encode(), "sampling_params"),
    (json.dumps({**GOOD, "sampling_params": {"temperature": "hot"}}).encode(), "sampling_params.temperature"),
    (json.dumps({**GOOD, "sampling_params": {"top_p": 0}}).encode(), "sampling_params.top_p"),
    (json.dumps({**GOOD, "sampling_params": {"max_new_tokens": -5}}).encode(), "sampling_params.max_new_tokens"),
    (json.dumps({**GOOD, "n": 2}).encode(), "n"),
    # oversized: the prompt plus the budget exceed the model's 1024 positions
    (json.dumps({"input_ids": [1] * 1000, "sampling_params": {"max_new_tokens": 100}}).encode(),
     "sampling_params.max_new_tokens"),
]


def test_malformed_requests_get_400_naming_the_field_and_the_server_keeps_serving(server):
    for body, field in REQUEST_CASES:
        status, reply = _post(server, body)
        assert status == 400, (body[:80], status, reply)
        assert reply["success"] is False and reply["error"]["field"] == field, (body[:80], reply)
        assert reply["message"] == reply["error"]["message"] and reply["message"], reply
    status, reply = _post(server, json.dumps(GOOD).encode())  # unaffected
    assert status == 200 and len(reply["output_ids"]) == 2


def test_oversized_body_is_refused_and_the_server_keeps_serving(server):
    # 64 MiB is the server's body limit (aiohttp client_max_size): refused with 413, no model work
    body = b'{"input_ids": [' + b"1," * (33 << 20) + b'1]}'
    status, _ = _post(server, body)
    assert status == 413
    status, reply = _post(server, json.dumps(GOOD).encode())
    assert status == 200 and len(reply["output_ids"]) == 2


def test_unreachable_server_address_names_rollout_addresses():
    from arealite.inference.remote import RemoteInferenceEngine

    addr = f"127.0.0.1:{free_port()}"  # nothing listens there
    eng = RemoteInferenceEngine(InferenceEngineConfig(setup_timeout=1.0), [addr])
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"inference server {addr} not healthy.*rollout\.addresses"):
        eng.initialize()
    assert time.monotonic() - t0 < 15
