"""Evaluation: pass@k / maj@k on hand-made samples, and the ``arealite.evaluate`` CLI end to end on
a tiny random model (HF generate and our launched server)."""

import asyncio
import json
import math

import pytest

from arealite.reward.metrics import extract_final_answer, majority_correct, pass_at_k, summarize


def test_pass_at_k_equals_the_closed_form_on_hand_made_samples():
    # n = 5, c = 2, k = 2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # n = 10, c = 3, k = 5: 1 - C(7,5)/C(10,5) = 1 - 21/252 = 11/12
    assert pass_at_k(10, 3, 5) == pytest.approx(11 / 12)
    # pass@1 is the fraction correct
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    # n - c < k: every k-subset holds a correct sample; no correct sample: 0
    assert pass_at_k(4, 3, 2) == 1.0 and pass_at_k(6, 0, 3) == 0.0
    for n, c, k in [(20, 7, 4), (100, 13, 10), (8, 5, 8)]:  # the stable product = math.comb form
        assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), rel=1e-12)
    with pytest.raises(ValueError, match="n-samples"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="correct samples"):
        pass_at_k(4, 5, 1)


def test_the_reward_the_evaluator_and_the_vote_share_one_answer_module():
    import arealite.evaluate as ev
    import arealite.reward.answer as answer
    import arealite.reward.math as rm
    import arealite.reward.metrics as metrics

    assert rm.extract_final_answer is answer.extract_final_answer is metrics.extract_final_answer
    assert ev.extract_final_answer is answer.extract_final_answer
    assert rm.answers_equivalent is answer.answers_equivalent is metrics.answers_equivalent
    assert metrics.group_answers is answer.group_answers


def test_extract_final_answer_gives_whole_expressions_for_voting():
    assert extract_final_answer("so the answer is \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert extract_final_answer("x = 0.5") == "0.5"
    assert extract_final_answer("total 1,250 dollars") == "1250"
    assert extract_final_answer("\\boxed{x^{2}+1} then \\boxed{ 2.50 }") == "2.50"
    assert extract_final_answer("\\boxed{(1, 2)}") == "(1, 2)"
    assert extract_final_answer("no number here") is None


def test_votes_group_answers_the_reward_judges_equal():
    from arealite.reward.answer import group_answers

    forms = ["\\dfrac{1}{2}", "\\tfrac12", "\\frac12", "0.5", "1/2", "50%", "0.50"]
    assert group_answers(forms) == [0] * len(forms)
    assert group_answers(["3", None, "0.5", "3.0", "\\frac{6}{2}", "\\frac{1}{2}"]) == [0, None, 2, 0, 0, 2]
    # Four spellings of 1/2 (right) against three identical wrong strings: the right answer wins,
    # although as raw strings "1/3" has the most votes.
    texts = ["\\boxed{\\dfrac{1}{2}}", "\\boxed{1/3}", "\\boxed{\\frac12}", "\\boxed{1/3}", "the answer is 0.5",
             "\\boxed{1/3}", "\\boxed{\\tfrac{1}{2}}"]
    answers = [extract_final_answer(t) for t in texts]
    correct = [a != "1/3" for a in answers]
    assert majority_correct(answers, correct, 7) is True


def test_majority_vote_on_hand_made_answers():
    answers = ["3", "4", "4", None, "3", "3"]
    correct = [True, False, False, False, True, True]
    assert majority_correct(answers, correct, 6) is True  # "3" x3 beats "4" x2
    assert majority_correct(answers, correct, 3) is False  # first 3: "4" x2 beats "3" x1
    assert majority_correct(["4", "3"], [False, True], 2) is False  # tie: the first seen ("4") wins
    assert majority_correct([None, None], [False, False], 2) is False
    with pytest.raises(ValueError, match="k=3"):
        majority_correct(["1", "2"], [True, False], 3)


def test_summarize_means_over_problems():
    recs = [{"correct": [True, False, False, False], "answers": ["1", "2", "2", "3"]},  # pass@2 = 1 - 3/6
            {"correct": [True, True, False, False], "answers": ["5", "5", "6", None]}]  # pass@2 = 1 - 1/6
    m = summarize(recs, [2, 4])
    assert m["pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    assert m["pass@2"] == pytest.approx((0.5 + 5 / 6) / 2)
    assert m["pass@4"] == pytest.approx(1.0)
    assert m["maj@2"] == pytest.approx(1.0)  # problem 1: tie "1"/"2" → "1" (right); problem 2: "5" x2 (right)
    assert m["maj@4"] == pytest.approx(0.5)  # problem 1: "2" x2 (wrong); problem 2: "5" x2 (right)
    assert m["n_problems"] == 2 and m["n_samples"] == 4


def _cli(tmp_path, model, *extra):
    from arealite.evaluate import main

    out = tmp_path / "eval.jsonl"
    res = main(["--model-path", model, "--size", "3", "--max-new-tokens", "4", "--output", str(out),
                "--num-threads", "1", *extra])
    return res, [json.loads(line) for line in open(out)]


def test_cli_hf_generate_writes_table_and_jsonl(tiny_model_dir, tmp_path, capsys):
    res, recs = _cli(tmp_path, tiny_model_dir, "--dataset", "arithmetic", "--n-samples", "4",
                     "--temperature", "1.0", "--k", "1,2,4")
    printed = capsys.readouterr().out
    assert "pass@1" in printed and "maj@4" in printed and "arithmetic" in printed
    assert len(recs) == 3 and all(len(r["completions"]) == 4 and len(r["correct"]) == 4 for r in recs)
    m = res["arithmetic"]
    # the printed metrics are those of the written samples
    assert m["pass@1"] == pytest.approx(sum(sum(r["correct"]) for r in recs) / 12)
    assert m["pass@4"] == pytest.approx(sum(any(r["correct"]) for r in recs) / 3)


def test_cli_through_a_launched_server_matches_greedy_hf(tiny_model_dir, tmp_path):
    hf, _ = _cli(tmp_path, tiny_model_dir, "--dataset", "arithmetic")
    served, recs = _cli(tmp_path, tiny_model_dir, "--dataset", "arithmetic", "--launch", "--n-samples", "2")
    assert all(r["completions"][0] == r["completions"][1] for r in recs)  # greedy: identical samples
    assert sorted(r["index"] for r in recs) == [0, 1, 2]  # one record per problem, written as each finishes
    assert served["arithmetic"]["pass@1"] == pytest.approx(hf["arithmetic"]["pass@1"])


def test_a_killed_hf_evaluation_keeps_every_finished_problem(tiny_model_dir, tmp_path):
    """SIGKILL (no clean-up runs) once the first records are on disk: every line is a whole record
    of a distinct problem, and the file grew while generation went on (per ``generate`` call)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import env_without_dist

    out = tmp_path / "eval.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "arealite.evaluate", "--model-path", tiny_model_dir, "--size", "400",
                             "--max-new-tokens", "16", "--batch-size", "1", "--num-threads", "1", "--output", str(out)],
                            env=env_without_dist(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 3):
            assert proc.poll() is None, "the evaluation ended before it was killed"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = out.read_text().splitlines()
    recs = [json.loads(line) for line in lines]  # whole lines only: each was flushed in one write
    assert 3 <= len(recs) < 400
    assert [r["index"] for r in recs] == list(range(len(recs)))  # in order, none missing
    assert all(len(r["completions"]) == 1 and len(r["correct"]) == 1 for r in recs)


def test_named_datasets_resolve_to_hub_names_or_the_given_file(tmp_path):
    """``--dataset gsm8k`` / ``math500`` name the hub sets (loaded by ``datasets`` when read; no
    network here), a path is used as given, and a missing file fails before any model is loaded."""
    import os

    from arealite.evaluate import resolve_dataset

    assert resolve_dataset("gsm8k") == "openai/gsm8k" and resolve_dataset("math500") == "HuggingFaceH4/MATH-500"
    assert resolve_dataset("arithmetic") is None
    local = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "gsm8k", "test.jsonl")
    assert resolve_dataset(local) == local
    with pytest.raises(ValueError, match="does not exist"):
        resolve_dataset(str(tmp_path / "missing.jsonl"))


def test_cli_refuses_bad_k_before_loading_anything(tmp_path):
    from arealite.evaluate import main

    with pytest.raises(SystemExit):
        main(["--n-samples", "2", "--k", "4", "--model-path", str(tmp_path / "missing")])


def test_background_evaluator_returns_once_with_the_version():
    from arealite.evaluate import BackgroundEvaluator

    async def slow():
        await asyncio.sleep(0.2)
        return {"accuracy": 0.25}

    ev = BackgroundEvaluator(slow)
    assert ev.start(3) and not ev.start(4)  # one at a time
    assert ev.poll() == {}  # still running: the caller does not wait
    res = ev.poll(wait=None)
    assert res["eval/accuracy"] == 0.25 and res["eval/version"] == 3.0 and res["eval/time_s"] >= 0.2
    assert ev.poll() == {}


def test_in_loop_sampled_evaluation_scores_pass_and_majority(tiny_model_dir):
    """``evaluator.n_samples > 1``: :func:`aevaluate_samples` through an engine whose completions
    are scripted per problem. Problem A (answer 4): samples 4, 5, 4, 4 -> 3/4 correct, majority 4
    (right); problem B (answer 7): 1, 7, 1, 2 -> 1/4 correct, majority 1 (wrong).
    pass@1 = (3/4 + 1/4)/2 = 0.5; pass@4 = 1 (both have a correct sample); maj@4 = 1/2."""
    from arealite.api.config import GenerationConfig
    from arealite.api.io_struct import ModelResponse
    from arealite.evaluate import aevaluate_samples
    from arealite.utils.hf import load_tokenizer, tokenize_chat

    tok = load_tokenizer(tiny_model_dir)
    rows = [{"messages": [{"role": "user", "content": "2+2?"}], "answer": "4"},
            {"messages": [{"role": "user", "content": "3+4?"}], "answer": "7"}]
    script = {tuple(tokenize_chat(tok, rows[0]["messages"])): ["4", "5", "4", "4"],
              tuple(tokenize_chat(tok, rows[1]["messages"])): ["1", "7", "1", "2"]}
    seen: dict[tuple, int] = {}

    class Scripted:
        async def agenerate(self, req):
            assert req.gconfig.temperature == 0.7 and not req.gconfig.greedy and req.gconfig.n_samples == 1
            key = tuple(req.input_ids)
            i = seen[key] = seen.get(key, -1) + 1
            return ModelResponse(input_tokens=list(req.input_ids),
                                 output_tokens=tok.encode(f"The answer is {script[key][i]}.", add_special_tokens=False))

        async def aclose(self):
            pass

    res = asyncio.run(aevaluate_samples(Scripted(), tok, rows, 4, GenerationConfig(max_new_tokens=8, temperature=0.7)))
    assert seen == {k: 3 for k in script}  # 4 samples of each problem
    assert res == {"pass@1": 0.5, "pass@4": 1.0, "maj@4": 0.5}
    assert list(res) == ["pass@1", "pass@4", "maj@4"]  # the progress line shows the first


def test_evaluator_fields_are_checked(tmp_path):
    from arealite.api.cli import ConfigError, validate_config
    from arealite.api.config import EvalConfig

    for field, value in (("n_samples", 0), ("temperature", 0.0), ("freq_steps", -1)):
        cfg = EvalConfig(**{field: value})
        with pytest.raises(ConfigError, match=f"evaluator.{field}|{field}"):
            validate_config(cfg)


def test_size_0_reads_the_whole_embedded_test_pool(tiny_model_dir, tmp_path, monkeypatch):
    import arealite.evaluate as ev
    from arealite.dataset.math_data import arithmetic_pool, load_dataset

    asked = []

    def spy(path, split, size, seed):
        asked.append((path, split, size))
        return load_dataset(path, split, 2, seed)  # two problems are enough to run the CLI

    monkeypatch.setattr(ev, "load_dataset", spy)
    ev.main(["--model-path", tiny_model_dir, "--size", "0", "--max-new-tokens", "2", "--num-threads", "1",
             "--output", str(tmp_path / "e.jsonl")])
    assert asked == [(None, "test", len(arithmetic_pool("test")))]
    assert len(arithmetic_pool("test")) > 200  # more than the loader's default
