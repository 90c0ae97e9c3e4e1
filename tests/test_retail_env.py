"""The τ-bench-style retail domain (arealite.env.retail): a seeded store database, tools that change
it exactly, τ-bench's reward (final database == goal database, required outputs said), policy
violations, the scripted and the LLM customer, and a whole episode through MultiTurnWorkflow.

Expected values are written out by hand from the seed-0 database: customer kessa_esterby_5260
(kessa.esterby5260@example.com, gift_card_2159058) owns the pending order #W4610478 (12.0 + 29.0 +
64.0 = 105.0) and the delivered orders #W3184803 (34.5) and #W7564858 (15.5 + 21.75 + 64.0 = 101.25);
marro_nettle_9071 owns the pending #W2935247."""

import asyncio
import copy
import json
import re

import pytest
from transformers import AutoTokenizer

from arealite.api.config import GenerationConfig
from arealite.env.retail import (CANCEL_REASONS, EASY_POLICY, POLICY, STOP, LLMUser, RetailEnv, ScriptedUser,
                                 apply_actions, db_hash, load_retail_db, make_retail_db, make_retail_tasks,
                                 make_retail_tools)
from arealite.env.tools import ToolError, truncate_after_tool_call
from arealite.workflow.multi_turn import MultiTurnWorkflow

KESSA, EMAIL, PAY = "kessa_esterby_5260", "kessa.esterby5260@example.com", "gift_card_2159058"
PENDING, DELIVERED, DELIVERED2, MARRO_PENDING = "#W4610478", "#W3184803", "#W7564858", "#W2935247"
PENDING_ORDER = {"order_id": PENDING, "user_id": KESSA, "items": ["2210484339", "2332073689", "8232655914"],
                 "status": "pending", "payment_method": PAY}
DELIVERED_ORDER = {"order_id": DELIVERED, "user_id": KESSA, "items": ["8921731533"], "status": "delivered",
                   "payment_method": PAY}


def call(name, **arguments):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


FIND = call("find_user_id_by_email", email=EMAIL)


def row(intent, order_id=PENDING, difficulty="easy", reason="no longer needed", outputs=(), first=None):
    """A hand-written task row (what make_retail_tasks makes) on the seed-0 database."""
    write = {"cancel": {"name": "cancel_pending_order", "arguments": {"order_id": order_id, "reason": reason}},
             "return": {"name": "return_delivered_order", "arguments": {"order_id": order_id}},
             "status": {"name": "get_order_details", "arguments": {"order_id": order_id}}}[intent]
    if first is None:
        first = (f"Hi! Please {intent} my order {order_id}, reason: {reason}. My email is {EMAIL}."
                 if difficulty == "easy" else f"Hi, I'd like to {intent} an order.")
    return {"task_id": "t", "difficulty": difficulty, "intent": intent, "order_id": order_id, "user_id": KESSA,
            "email": EMAIL, "reason": reason if intent == "cancel" else None, "instruction": f"You want to {intent} {order_id}.",
            "first_message": first, "gold_actions": [{"name": "find_user_id_by_email", "arguments": {"email": EMAIL}}, write],
            "outputs": list(outputs), "db_seed": 0, "db_n_users": 20, "db_max_orders_per_user": 3}


def scripted_env(**kw):
    return RetailEnv(lambda task: ScriptedUser(), **kw)


def play(env, data, completions):
    """Reset ``env`` on ``data`` and feed it ``completions`` until done: (first messages, steps, summed info)."""
    async def main():
        first = await env.areset(data)
        steps = []
        for c in completions:
            steps.append(await env.astep(c))
            if steps[-1].done:
                break
        return first, steps
    first, steps = asyncio.run(main())
    info = {}
    for s in steps:
        for k, v in s.info.items():
            info[k] = info.get(k, 0) + v
    return first, steps, info


# --------------------------------------------------------------------------- database and tasks

def test_the_database_is_deterministic_in_its_seed_and_json_serialisable():
    a, b, c = make_retail_db(0), make_retail_db(0), make_retail_db(1)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert json.dumps(a, sort_keys=True) != json.dumps(c, sort_keys=True)
    assert db_hash(a) == db_hash(b) != db_hash(c)
    assert json.loads(json.dumps(a)) == a and a["meta"] == {"seed": 0, "n_users": 20, "max_orders_per_user": 3}
    assert len(a["users"]) == 20 and len(make_retail_db(0, n_users=5)["users"]) == 5
    assert a["orders"][PENDING] == PENDING_ORDER and a["orders"][DELIVERED] == DELIVERED_ORDER
    assert a["users"][KESSA] == {"user_id": KESSA, "name": "Kessa Esterby", "email": EMAIL, "zip": "21773",
                                 "orders": [DELIVERED, DELIVERED2, PENDING]}
    assert all(re.fullmatch(r"#W\d{7}", o) for o in a["orders"])
    assert all(a["orders"][o]["user_id"] == u for u, user in a["users"].items() for o in user["orders"])
    # the cached copy is a fresh deep copy: mutating one never reaches the next
    load_retail_db(0)["orders"][PENDING]["status"] = "cancelled"
    assert load_retail_db(0) == a
    with pytest.raises(ValueError, match="n_users"):
        make_retail_db(0, n_users=0)


def test_tasks_are_seeded_serialisable_and_achievable_under_the_policy():
    db = make_retail_db(0)
    for difficulty in ("easy", "hard"):
        tasks = make_retail_tasks(30, 5, db, difficulty)
        assert tasks == make_retail_tasks(30, 5, db, difficulty) != make_retail_tasks(30, 6, db, difficulty)
        assert json.loads(json.dumps(tasks)) == tasks
        assert {t["intent"] for t in tasks} == {"cancel", "return", "status"}
        for t in tasks:
            order = db["orders"][t["order_id"]]
            assert t["user_id"] == order["user_id"] and t["email"] == db["users"][order["user_id"]]["email"]
            assert t["db_seed"] == 0 and t["difficulty"] == difficulty
            goal = apply_actions(copy.deepcopy(db), t["gold_actions"])  # raises if a gold action fails
            changed = [o for o in db["orders"] if db["orders"][o] != goal["orders"][o]]
            if t["intent"] == "cancel":
                assert order["status"] == "pending" and t["reason"] in CANCEL_REASONS and t["outputs"] == []
                assert changed == [t["order_id"]] and goal["orders"][t["order_id"]]["status"] == "cancelled"
            elif t["intent"] == "return":
                assert order["status"] == "delivered" and t["outputs"] == []
                assert changed == [t["order_id"]] and goal["orders"][t["order_id"]]["status"] == "return requested"
            else:
                assert changed == [] and t["outputs"] == [order["status"]]
            said = t["first_message"]
            if difficulty == "easy":
                assert t["order_id"] in said and t["email"] in said and (t["reason"] or "") in said
            else:
                assert t["order_id"] not in said and t["email"] not in said and "@" not in said
    with pytest.raises(ValueError, match="difficulty"):
        make_retail_tasks(1, 0, db, "medium")


def test_tools_change_a_hand_written_database_exactly():
    db = {"meta": {}, "products": {"1": {"item_id": "1", "name": "lamp", "price": 34.5},
                                   "2": {"item_id": "2", "name": "bottle", "price": 18.0}},
          "users": {"ann_1": {"user_id": "ann_1", "name": "Ann", "email": "ann@example.com", "zip": "12345",
                              "orders": ["#W1000001", "#W1000002"]}},
          "orders": {"#W1000001": {"order_id": "#W1000001", "user_id": "ann_1", "items": ["1", "2"],
                                   "status": "pending", "payment_method": "paypal_1"},
                     "#W1000002": {"order_id": "#W1000002", "user_id": "ann_1", "items": ["2"],
                                   "status": "delivered", "payment_method": "paypal_1"}}}
    tools = {t.name: t for t in make_retail_tools(db)}
    assert sorted(n for n, t in tools.items() if t.writes) == ["cancel_pending_order", "return_delivered_order"]
    for t in tools.values():  # schemas name every argument of the function
        assert t.schema()["function"]["parameters"]["required"] == list(t.parameters["properties"])
    assert tools["find_user_id_by_email"].fn(email="ann@example.com") == "ann_1"
    assert json.loads(tools["cancel_pending_order"].fn(order_id="#W1000001", reason="ordered by mistake"))["status"] == "cancelled"
    assert db["orders"]["#W1000001"] == {"order_id": "#W1000001", "user_id": "ann_1", "items": ["1", "2"],
                                         "status": "cancelled", "payment_method": "paypal_1",
                                         "cancel_reason": "ordered by mistake",
                                         "refund": {"amount": 52.5, "payment_method": "paypal_1"}}
    tools["return_delivered_order"].fn(order_id="#W1000002")
    assert db["orders"]["#W1000002"] == {"order_id": "#W1000002", "user_id": "ann_1", "items": ["2"],
                                         "status": "return requested", "payment_method": "paypal_1",
                                         "refund": {"amount": 18.0, "payment_method": "paypal_1"}}
    before = json.dumps(db, sort_keys=True)
    for name, args, message in [
            ("cancel_pending_order", {"order_id": "#W1000001", "reason": "no longer needed"}, "is cancelled; only pending"),
            ("return_delivered_order", {"order_id": "#W1000002"}, "is return requested; only delivered"),
            ("get_order_details", {"order_id": "#W9999999"}, "order #W9999999 not found"),
            ("get_order_details", {"order_id": 1000001}, "order_id must be a string"),
            ("get_user_details", {"user_id": "bob_2"}, "user bob_2 not found"),
            ("find_user_id_by_email", {"email": "bob@example.com"}, "user with email bob@example.com not found")]:
        with pytest.raises(ToolError, match=message):
            tools[name].fn(**args)
    assert json.dumps(db, sort_keys=True) == before


def test_a_cancel_needs_a_valid_reason():
    db = make_retail_db(0)
    cancel = {t.name: t for t in make_retail_tools(db)}["cancel_pending_order"]
    with pytest.raises(ToolError, match="reason must be one of"):
        cancel.fn(order_id=PENDING, reason="found it cheaper")
    assert db == make_retail_db(0)


# --------------------------------------------------------------------------- RetailEnv.astep on tool calls

def test_scripted_tool_calls_give_the_exact_database_state():
    env = scripted_env()
    first, steps, info = play(env, row("cancel"), [FIND, call("cancel_pending_order", order_id=PENDING, reason="no longer needed")])
    assert [m["role"] for m in first] == ["system", "user"]
    assert first[0]["content"].startswith(EASY_POLICY) and "<tools>" in first[0]["content"]
    assert '"name": "cancel_pending_order"' in first[0]["content"]
    assert steps[0].messages == [{"role": "user", "content": f"<tool_response>\n{KESSA}\n</tool_response>"}]
    expected = {**PENDING_ORDER, "status": "cancelled", "cancel_reason": "no longer needed",
                "refund": {"amount": 105.0, "payment_method": PAY}}
    assert env.db["orders"][PENDING] == expected
    assert json.loads(steps[1].messages[0]["content"].split("\n")[1]) == expected
    pristine = make_retail_db(0)
    assert env.db == {**pristine, "orders": {**pristine["orders"], PENDING: expected}}  # nothing else changed
    assert not any(s.done for s in steps) and info == {"tool_calls": 2, "tool_errors": 0, "policy_violations": 0}


def test_cancelling_a_delivered_order_is_a_tool_error_and_changes_nothing():
    env = scripted_env()
    _, steps, info = play(env, row("cancel"), [FIND, call("cancel_pending_order", order_id=DELIVERED, reason="no longer needed")])
    assert steps[1].messages == [{"role": "user", "content": f"<tool_response>\nError: order {DELIVERED} is delivered; "
                                                             "only pending orders can be cancelled\n</tool_response>"}]
    assert env.db == make_retail_db(0) and not steps[1].done
    assert info == {"tool_calls": 2, "tool_errors": 1, "policy_violations": 0}


def test_returning_a_delivered_order_requests_the_return():
    env = scripted_env()
    play(env, row("return", DELIVERED2), [FIND, call("return_delivered_order", order_id=DELIVERED2)])
    assert env.db["orders"][DELIVERED2] == {"order_id": DELIVERED2, "user_id": KESSA,
                                            "items": ["4874773259", "4900315155", "8232655914"],
                                            "status": "return requested", "payment_method": PAY,
                                            "refund": {"amount": 101.25, "payment_method": PAY}}


def test_episodes_of_one_task_never_share_the_database():
    async def main():
        a, b = scripted_env(), scripted_env()
        await a.areset(row("cancel"))
        await b.areset(row("cancel"))
        await a.astep(FIND)
        await a.astep(call("cancel_pending_order", order_id=PENDING, reason="no longer needed"))
        return a, b
    a, b = asyncio.run(main())
    assert a.db["orders"][PENDING]["status"] == "cancelled" and b.db["orders"][PENDING] == PENDING_ORDER


# --------------------------------------------------------------------------- whole scripted episodes: reward

DONE_CANCEL = f"Your order {PENDING} has been cancelled."


def test_easy_gold_episode_scores_1():
    _, steps, info = play(scripted_env(), row("cancel"),
                          [FIND, call("cancel_pending_order", order_id=PENDING, reason="no longer needed"), DONE_CANCEL])
    assert len(steps) == 3 and steps[-1].done and steps[-1].reward == 1.0
    assert info == {"tool_calls": 2, "tool_errors": 0, "policy_violations": 0, "user_turns": 1, "db_match": 1}


def test_hard_gold_episode_with_questions_and_confirmation_scores_1():
    env = scripted_env()
    data = row("cancel", difficulty="hard", reason="ordered by mistake")
    first, steps, info = play(env, data, [
        "Sure. What is your email, the order id and the reason?",
        FIND,
        f"I will cancel order {PENDING} (reason: ordered by mistake). Do you confirm (yes or no)?",
        call("cancel_pending_order", order_id=PENDING, reason="ordered by mistake"),
        DONE_CANCEL])
    assert first[0]["content"].startswith(POLICY) and first[1]["content"] == "Hi, I'd like to cancel an order."
    assert steps[0].messages == [{"role": "user", "content": f"My email is {EMAIL}. The order id is {PENDING}. "
                                                             "The reason is: ordered by mistake."}]
    assert steps[2].messages == [{"role": "user", "content": "yes"}]
    assert steps[-1].done and steps[-1].reward == 1.0
    assert info == {"tool_calls": 2, "tool_errors": 0, "policy_violations": 0, "user_turns": 3, "db_match": 1}


@pytest.mark.parametrize("wrong", [
    call("return_delivered_order", order_id=PENDING),  # return instead of cancel: a tool error, nothing changes
    call("cancel_pending_order", order_id=PENDING, reason="ordered by mistake"),  # the other reason
    call("cancel_pending_order", order_id=DELIVERED, reason="no longer needed"),  # another order (not pending)
])
def test_a_wrong_action_scores_0(wrong):
    _, steps, info = play(scripted_env(), row("cancel"), [FIND, wrong, DONE_CANCEL])
    assert steps[-1].done and steps[-1].reward == 0.0 and info["db_match"] == 0


def test_a_status_task_scores_only_when_the_agent_says_the_status():
    data = row("status", DELIVERED, outputs=["delivered"])
    _, steps, info = play(scripted_env(), data, [FIND, call("get_order_details", order_id=DELIVERED),
                                                 "I checked your order. All set, anything else?"])
    assert steps[-1].done and steps[-1].reward == 0.0 and info["db_match"] == 1  # the database is right, the answer missing
    _, steps, info = play(scripted_env(), data, [FIND, call("get_order_details", order_id=DELIVERED),
                                                 f"Your order {DELIVERED} is DELIVERED."])
    assert steps[-1].done and steps[-1].reward == 1.0 and info["db_match"] == 1 and info["user_turns"] == 1


def test_hard_write_without_confirmation_is_a_violation():
    data = row("cancel", difficulty="hard")
    script = ["What is your email and the order id and the reason?", FIND,
              call("cancel_pending_order", order_id=PENDING, reason="no longer needed"), DONE_CANCEL]
    _, steps, info = play(scripted_env(), data, script)
    assert steps[2].info["policy_violations"] == 1 and info["policy_violations"] == 1
    assert steps[-1].reward == 1.0  # counted, not punished by default (τ-bench scores the database)
    _, steps, info = play(scripted_env(strict_policy=True), data, script)
    assert info["policy_violations"] == 1 and steps[-1].done and steps[-1].reward == 0.0
    # one "yes" covers one write: the second write after it is a violation
    _, steps, info = play(scripted_env(), row("return", DELIVERED, difficulty="hard"), [
        "What is your email and the order id?", FIND, "Shall I return it? (yes or no)",
        call("return_delivered_order", order_id=DELIVERED), call("return_delivered_order", order_id=DELIVERED2)])
    assert [s.info["policy_violations"] for s in steps] == [0, 0, 0, 0, 1]


def test_writes_on_orders_of_an_unauthenticated_user_are_violations():
    # no authentication at all
    _, steps, info = play(scripted_env(), row("cancel"),
                          [call("cancel_pending_order", order_id=PENDING, reason="no longer needed"), DONE_CANCEL])
    assert info["policy_violations"] == 1 and steps[-1].reward == 1.0
    # kessa is authenticated, marro's order is not hers
    _, steps, info = play(scripted_env(), row("cancel"),
                          [FIND, call("cancel_pending_order", order_id=MARRO_PENDING, reason="no longer needed"), DONE_CANCEL])
    assert steps[1].info["policy_violations"] == 1 and steps[-1].reward == 0.0
    # a user id the customer said, looked up, authenticates; one the agent got elsewhere does not
    said = row("cancel", first=f"Cancel {PENDING}, reason: no longer needed. My user id is {KESSA}.")
    _, _, info = play(scripted_env(), said, [call("get_user_details", user_id=KESSA),
                                             call("cancel_pending_order", order_id=PENDING, reason="no longer needed")])
    assert info["policy_violations"] == 0
    _, _, info = play(scripted_env(), row("cancel"), [call("get_user_details", user_id=KESSA),
                                                      call("cancel_pending_order", order_id=PENDING, reason="no longer needed")])
    assert info["policy_violations"] == 1


def test_transfer_to_a_human_ends_the_episode():
    _, steps, info = play(scripted_env(), row("cancel"), [call("transfer_to_human_agents", summary="wants a cancel"), "x"])
    assert len(steps) == 1 and steps[0].done and steps[0].reward == 0.0
    assert info == {"tool_calls": 1, "tool_errors": 0, "policy_violations": 0, "db_match": 0}


def test_the_scripted_user_restates_its_request_and_gives_up_after_max_user_turns():
    async def main():
        user = ScriptedUser(max_user_turns=2)
        first = await user.areset(row("cancel", difficulty="hard"))
        return first, [await user.areply("Lovely weather today."), await user.areply("Tell me about it."),
                       await user.areply("What is your email?")]
    first, replies = asyncio.run(main())
    assert replies == [first, first, STOP]


# --------------------------------------------------------------------------- through MultiTurnWorkflow and with an LLM user

@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_a_gold_episode_through_the_workflow_is_trained_on_the_agent_tokens_only(tok):
    from test_proxy import ScriptedEngine

    replies = [FIND, call("cancel_pending_order", order_id=PENDING, reason="no longer needed"), DONE_CANCEL]
    engine = ScriptedEngine(tok, lambda prompt: replies[prompt.count("<tool_response>")])
    gconfig = GenerationConfig(n_samples=2, max_new_tokens=96, temperature=1.0)
    workflow = MultiTurnWorkflow(lambda data: scripted_env(), gconfig, tok, max_turns=6, turn_discount=1.0,
                                 max_context_tokens=4096, truncate_fn=truncate_after_tool_call)
    batch = asyncio.run(workflow.arun_episode(engine, row("cancel")))
    assert batch["rewards"].tolist() == [1.0, 1.0] and batch["turns"].tolist() == [3.0, 3.0]
    for r in range(2):
        ids, mask = batch["input_ids"][r], batch["loss_mask"][r].bool() & batch["attention_mask"][r]
        context = tok.decode(ids[~mask & batch["attention_mask"][r]].tolist())
        assert f"<tool_response>\n{KESSA}\n</tool_response>" in context and '"status": "cancelled"' in context
        assert "<tool_response>" not in tok.decode(ids[mask].tolist())
        assert tok.decode(ids[mask].tolist(), skip_special_tokens=True) == "".join(replies)
    assert engine.calls == 6


def test_llm_user_sees_the_conversation_with_roles_flipped_and_its_stop_ends_the_episode(tok):
    from test_proxy import ScriptedEngine

    prompts = []

    def reply(prompt):
        prompts.append(prompt)
        return ["I want to cancel an order.", f"My email is {EMAIL}.", STOP][len(prompts) - 1]

    gconfig = GenerationConfig(n_samples=4, max_new_tokens=32)
    engine = ScriptedEngine(tok, reply)
    env = RetailEnv(lambda task: LLMUser(engine, tok, gconfig))
    data = row("cancel", difficulty="hard")
    first, steps, info = play(env, data, ["Can I have your email?", "Thanks, one moment.", "never reached"])
    assert first[1] == {"role": "user", "content": "I want to cancel an order."}
    assert "Your goal: You want to cancel #W4610478." in prompts[0] and STOP in prompts[0]
    assert prompts[0].endswith("<|im_start|>user\nHi! How can I help you today?<|im_end|>\n<|im_start|>assistant\n")
    assert ("<|im_start|>assistant\nI want to cancel an order.<|im_end|>\n"
            "<|im_start|>user\nCan I have your email?<|im_end|>\n<|im_start|>assistant\n") in prompts[1]
    assert steps[0].messages == [{"role": "user", "content": f"My email is {EMAIL}."}]
    assert prompts[2].endswith(f"<|im_start|>assistant\nMy email is {EMAIL}.<|im_end|>\n"
                               "<|im_start|>user\nThanks, one moment.<|im_end|>\n<|im_start|>assistant\n")
    assert len(steps) == 2 and steps[1].done and steps[1].reward == 0.0  # stopped before anything was done
    assert info == {"user_turns": 2, "policy_violations": 0, "db_match": 0} and engine.calls == 3


# --------------------------------------------------------------------------- tag calls and demonstrations

def test_tag_calls_and_demonstrations_reach_the_same_database_state():
    """The small-model form: ``<tool>args</tool>`` calls (arguments in schema order, " | "-separated) drive
    the same tools; the demonstrations are real episodes on another store, in the env's own format."""
    from arealite.env.retail import DEMO_SEED, retail_stops

    env = scripted_env(call_format="tags", demos=True)
    first, steps, info = play(env, row("cancel"), [
        f"<find_user_id_by_email>{EMAIL}</find_user_id_by_email>",
        f"<cancel_pending_order>{PENDING} | no longer needed</cancel_pending_order>",
        f"Done: order {PENDING} is cancelled."])
    assert steps[-1].done and steps[-1].reward == 1.0 and info["db_match"] == 1 and info["policy_violations"] == 0
    assert steps[0].messages[0]["content"] == f"<information>{KESSA}</information>"
    assert env.db["orders"][PENDING]["status"] == "cancelled" and env.db["orders"][PENDING]["cancel_reason"] == "no longer needed"
    assert retail_stops("tags") == tuple(f"</{t.name}>" for t in env.tools) and retail_stops("hermes") == ("</tool_call>",)
    # demonstrations: system, then 3 worked episodes (user, calls and outputs, closing), then the task
    assert first[0]["role"] == "system" and first[-1] == {"role": "user", "content": row("cancel")["first_message"]}
    demo = first[1:-1]
    assert [m["role"] for m in demo].count("user") == 3 + 6  # 3 first messages + 2 tool outputs each (role user)
    demo_db = load_retail_db(DEMO_SEED)
    for m in demo:
        if m["role"] == "assistant" and m["content"].startswith("<cancel_pending_order>"):
            order_id = m["content"].split(">")[1].split(" | ")[0]
            assert demo_db["orders"][order_id]["status"] == "pending"  # a real, cancellable demo order
            assert order_id not in load_retail_db(0)["orders"]
    assert all(m["content"].startswith(("<information>", "Hi")) for m in demo if m["role"] == "user")
