"""A τ-bench-style retail customer-service domain (Yao et al. 2024, "τ-bench: A Benchmark for
Tool-Agent-User Interaction in Real-World Domains", arXiv 2406.12045), small enough for a 135M model.

The agent talks to a simulated customer (:class:`ScriptedUser` or an LLM, :class:`LLMUser`) and to a
store database through tools (:func:`make_retail_tools`) under a written policy (:data:`POLICY`).
One episode (:class:`RetailEnv`, a :class:`~arealite.env.tools.ToolEnv`):

    system: policy + tool schemas          user: "Hi! Please cancel my order #W1234567 ..."
    agent:  <tool_call>{"name": "find_user_id_by_email", ...}</tool_call>
    user:   <tool_response>...</tool_response>     (tool output; not the customer)
    agent:  <tool_call>{"name": "cancel_pending_order", ...}</tool_call>
    user:   <tool_response>...</tool_response>
    agent:  "Your order #W1234567 has been cancelled."   → goes to the customer
    user:   ###STOP###                                      → the episode ends, scored

Reward, as in τ-bench: 1 iff the final database equals the goal database (the pristine one with
the task's ``gold_actions`` applied by the same tool functions; compared as canonical JSON) and every
string of the task's ``outputs`` was said to the customer; else 0. Policy violations (acting on an
order whose owner was not authenticated; in the hard variant, writing without the customer's explicit
"yes") are counted in ``info["policy_violations"]`` and cost nothing unless ``strict_policy``.

Calls are Hermes JSON by default; ``call_format="tags"`` gives ``<cancel_pending_order>#W1234567 | no
longer needed</cancel_pending_order>`` (:mod:`arealite.env.tools`), which SmolLM2-135M writes after the
worked demonstrations of :meth:`RetailEnv.demonstrations` (``demos=True``); the customers are in
:mod:`arealite.env.users`.

Everything here is plain dicts and deterministic in the seeds; the database is rebuilt from the
row's ``db_seed`` (the pristine JSON is cached per process, each episode gets its own copy).
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import re
from typing import Any, Callable

from arealite.api.env import StepResult
from arealite.env.tools import Tool, ToolEnv, ToolError
from arealite.env.users import STOP, LLMUser, ScriptedUser, UserSimulator  # noqa: F401 - re-exported

ORDER_STATUSES = ("pending", "processed", "delivered", "cancelled", "return requested")
CANCEL_REASONS = ("no longer needed", "ordered by mistake")  # τ-bench's only accepted reasons
INTENTS = ("cancel", "return", "status")
DIFFICULTIES = ("easy", "hard")

_FIRST = ["Mira", "Tovan", "Elsie", "Boran", "Quilla", "Darek", "Ysolde", "Fenn", "Harlo", "Ines",
          "Jorvik", "Kessa", "Lunet", "Marro", "Nadia", "Orrin", "Pella", "Rusk", "Saffi", "Teodor"]
_LAST = ["Vantree", "Oakhollow", "Brisk", "Calloway", "Drummel", "Esterby", "Fallow", "Grisby",
         "Hallorin", "Ivers", "Jessop", "Kittering", "Lowmarsh", "Merrow", "Nettle", "Pembry"]
_PRODUCTS = [("Lumen desk lamp", 34.5), ("Trailwise water bottle", 18.0), ("Corkline yoga mat", 42.25),
             ("Brevo coffee grinder", 89.99), ("Nimbus throw pillow", 21.75), ("Quartzo wall clock", 27.4),
             ("Velt running socks", 12.0), ("Harbor canvas tote", 24.95), ("Pinecrest candle", 15.5),
             ("Solace bath towel", 29.0), ("Arden notebook", 8.75), ("Tidal bluetooth speaker", 64.0)]
# orders are mostly in the states the tasks need (pending: cancel, delivered: return)
_STATUS_WEIGHTS = (0.35, 0.15, 0.35, 0.1, 0.05)


def _money(x: float) -> float:
    return round(x + 1e-9, 2)


def make_retail_db(seed: int, n_users: int = 20, max_orders_per_user: int = 3) -> dict[str, Any]:
    """A deterministic store database built from ``random.Random(seed)`` (fictional names).

    Args:
        seed: the only source of randomness (same seed → an equal database).
        n_users: number of customers (at most len(first names) × len(last names)).
        max_orders_per_user: each customer has 1..this many orders.

    Returns: ``{"meta": {"seed", "n_users", "max_orders_per_user"}, "users": {user_id: {"user_id",
    "name", "email", "zip", "orders": [order_id, ...]}}, "products": {item_id: {"item_id", "name",
    "price"}}, "orders": {order_id: {"order_id", "user_id", "items": [item_id, ...], "status",
    "payment_method"}}}`` (plain dicts, JSON-serialisable). Order ids look like ``#W1234567``;
    statuses are in :data:`ORDER_STATUSES`. A cancel adds ``cancel_reason`` and ``refund``, a
    return adds ``refund`` (see :func:`make_retail_tools`).

    Raises:
        ValueError: ``n_users`` < 1, more than the distinct names, or ``max_orders_per_user`` < 1.
    """
    if not 1 <= n_users <= len(_FIRST) * len(_LAST):
        raise ValueError(f"n_users must be in [1, {len(_FIRST) * len(_LAST)}], got {n_users}")
    if max_orders_per_user < 1:
        raise ValueError(f"max_orders_per_user must be >= 1, got {max_orders_per_user}")
    rng = random.Random(seed)
    products = {}
    for name, price in _PRODUCTS:
        item_id = str(rng.randrange(10**9, 10**10))
        products[item_id] = {"item_id": item_id, "name": name, "price": price}
    item_ids = list(products)
    names = rng.sample([(f, l) for f in _FIRST for l in _LAST], n_users)
    users, orders, used = {}, {}, set()
    for first, last in names:
        tag = rng.randrange(1000, 10000)
        user_id = f"{first.lower()}_{last.lower()}_{tag}"
        payment = f"{rng.choice(['credit_card', 'gift_card', 'paypal'])}_{rng.randrange(10**6, 10**7)}"
        user = {"user_id": user_id, "name": f"{first} {last}", "email": f"{first.lower()}.{last.lower()}{tag}@example.com",
                "zip": f"{rng.randrange(10000, 100000)}", "orders": []}
        for _ in range(rng.randint(1, max_orders_per_user)):
            while (order_id := f"#W{rng.randrange(10**6, 10**7)}") in used:
                pass
            used.add(order_id)
            orders[order_id] = {"order_id": order_id, "user_id": user_id,
                                "items": sorted(rng.sample(item_ids, rng.randint(1, 3))),
                                "status": rng.choices(ORDER_STATUSES, _STATUS_WEIGHTS)[0],
                                "payment_method": payment}
            user["orders"].append(order_id)
        users[user_id] = user
    return {"meta": {"seed": seed, "n_users": n_users, "max_orders_per_user": max_orders_per_user},
            "users": users, "products": products, "orders": orders}


def db_hash(db: dict[str, Any]) -> str:
    """SHA-256 of the database's canonical JSON (sorted keys, no spaces): equal iff the states are equal."""
    return hashlib.sha256(json.dumps(db, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@functools.lru_cache(maxsize=64)
def _pristine_json(seed: int, n_users: int, max_orders_per_user: int) -> str:
    """The pristine database as JSON (an immutable cache entry; ``json.loads`` is a fresh deep copy)."""
    return json.dumps(make_retail_db(seed, n_users, max_orders_per_user))


def load_retail_db(seed: int, n_users: int = 20, max_orders_per_user: int = 3) -> dict[str, Any]:
    """A fresh copy of :func:`make_retail_db`'s database, built once per process and arguments
    (concurrent episodes share the cached pristine JSON; each gets its own dicts)."""
    return json.loads(_pristine_json(seed, n_users, max_orders_per_user))


def _obj(**properties: str) -> dict[str, Any]:
    return {"type": "object", "properties": {k: {"type": "string", "description": d} for k, d in properties.items()},
            "required": list(properties)}


def _order_total(db: dict[str, Any], order: dict[str, Any]) -> float:
    return _money(sum(db["products"][i]["price"] for i in order["items"]))


# (name, description, JSON-schema parameters, writes) of the six tools, in the order the model sees them
_ORDER_ID = {"type": "string", "description": "the order id, with '#', e.g. #W1234567"}
_TOOL_SPECS = [
    ("find_user_id_by_email", "Find a user's id by their email address.",
     _obj(email="the user's email, e.g. mira.vantree1234@example.com"), False),
    ("get_user_details", "Get a user's details, including their order ids.",
     _obj(user_id="the user id, e.g. mira_vantree_1234"), False),
    ("get_order_details", "Get an order's status, items and owner.", _obj(order_id=_ORDER_ID["description"]), False),
    ("cancel_pending_order", "Cancel a pending order.",
     {"type": "object", "properties": {"order_id": _ORDER_ID, "reason": {
         "type": "string", "enum": list(CANCEL_REASONS), "description": "why the user cancels"}},
      "required": ["order_id", "reason"]}, True),
    ("return_delivered_order", "Request a return of a delivered order.", _obj(order_id=_ORDER_ID["description"]), True),
    ("transfer_to_human_agents", "Transfer the user to a human agent (only if the request is outside the tools).",
     _obj(summary="a short summary of the user's issue"), False),
]


def make_retail_tools(db: dict[str, Any], on_lookup: Callable[[str, str], None] | None = None,
                      on_write: Callable[[str, dict[str, Any]], None] | None = None,
                      on_transfer: Callable[[str], None] | None = None) -> list[Tool]:
    """The six tools of :data:`_TOOL_SPECS`, bound to ``db`` (they read and mutate it in place).

    Writes: ``cancel_pending_order`` ("pending" → "cancelled", adds ``cancel_reason`` and ``refund``),
    ``return_delivered_order`` ("delivered" → "return requested", adds ``refund``); outputs are the
    record's JSON (τ-bench's). Hooks: ``on_lookup(tool, user_id)`` after a successful user lookup,
    ``on_write(tool, order)`` on a write to an existing order (before the status check),
    ``on_transfer(summary)``. The tools raise :class:`ToolError` (text for the model, the episode goes
    on) for an unknown email / user / order, a non-string argument, a wrong status, a reason outside
    :data:`CANCEL_REASONS`.
    """

    def _str(name: str, value: Any) -> str:
        if not isinstance(value, str):
            raise ToolError(f"{name} must be a string, got {json.dumps(value)}")
        return value.strip()

    def _order(order_id: Any) -> dict[str, Any]:
        order_id = _str("order_id", order_id)
        if order_id not in db["orders"]:
            raise ToolError(f"order {order_id} not found (order ids look like #W1234567)")
        return db["orders"][order_id]

    def find_user_id_by_email(email):
        email = _str("email", email).lower()
        for user in db["users"].values():
            if user["email"] == email:
                if on_lookup:
                    on_lookup("find_user_id_by_email", user["user_id"])
                return user["user_id"]
        raise ToolError(f"user with email {email} not found")

    def get_user_details(user_id):
        user_id = _str("user_id", user_id)
        if user_id not in db["users"]:
            raise ToolError(f"user {user_id} not found")
        if on_lookup:
            on_lookup("get_user_details", user_id)
        return json.dumps(db["users"][user_id])

    def get_order_details(order_id):
        return json.dumps(_order(order_id))

    def _write(tool: str, order_id: Any, status: str, verb: str) -> dict[str, Any]:
        order = _order(order_id)
        if on_write:
            on_write(tool, order)
        if order["status"] != status:
            raise ToolError(f"order {order['order_id']} is {order['status']}; only {status} orders can be {verb}")
        return order

    def cancel_pending_order(order_id, reason):
        order = _write("cancel_pending_order", order_id, "pending", "cancelled")
        reason = _str("reason", reason)
        if reason not in CANCEL_REASONS:
            raise ToolError(f"reason must be one of {list(CANCEL_REASONS)}, got {reason!r}")
        order.update(status="cancelled", cancel_reason=reason,
                     refund={"amount": _order_total(db, order), "payment_method": order["payment_method"]})
        return json.dumps(order)

    def return_delivered_order(order_id):
        order = _write("return_delivered_order", order_id, "delivered", "returned")
        order.update(status="return requested",
                     refund={"amount": _order_total(db, order), "payment_method": order["payment_method"]})
        return json.dumps(order)

    def transfer_to_human_agents(summary):
        summary = _str("summary", summary)
        if on_transfer:
            on_transfer(summary)
        return "Transfer successful"

    fns = {f.__name__: f for f in (find_user_id_by_email, get_user_details, get_order_details, cancel_pending_order,
                                   return_delivered_order, transfer_to_human_agents)}
    return [Tool(name, description, parameters, fns[name], writes=writes)
            for name, description, parameters, writes in _TOOL_SPECS]


def apply_actions(db: dict[str, Any], actions: list[dict[str, Any]]) -> dict[str, Any]:
    """Apply ``actions`` (``[{"name", "arguments"}]``) to ``db`` in place through the tools of
    :func:`make_retail_tools` and return it (how the goal database of a task is made).

    Raises:
        ToolError: an action fails (a task whose gold actions fail is broken).
        KeyError: an unknown tool name.
    """
    tools = {t.name: t for t in make_retail_tools(db)}
    for action in actions:
        tools[action["name"]].fn(**action["arguments"])
    return db


_RULES = [
    "You are a customer service agent of an online store. Help the user with one order.",
    "- First authenticate the user: find their user id by their email (or use the user id they give you). "
    "Act only on orders of the authenticated user.",
    "- Only pending orders can be cancelled, with reason 'no longer needed' or 'ordered by mistake'. "
    "Only delivered orders can be returned. Use get_order_details to check an order's status.",
    "- Before a cancel or a return, state the action and ask the user to confirm (yes or no); "
    "act only after an explicit yes.",
    "- Transfer to a human agent only if the request cannot be handled with your tools.",
    "- When the request is done, tell the user what was done (or the order's status).",
]
POLICY = "\n".join(_RULES)  # the hard variant's policy (with the confirmation rule)
EASY_POLICY = "\n".join(r for r in _RULES if "confirm" not in r)  # the easy variant's: no confirmation


def policy_for(difficulty: str) -> str:
    """:data:`POLICY` for "hard", :data:`EASY_POLICY` (no confirmation step) for "easy"."""
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty must be one of {DIFFICULTIES}, got {difficulty!r}")
    return POLICY if difficulty == "hard" else EASY_POLICY


def _first_message(intent: str, difficulty: str, order_id: str, email: str, reason: str | None) -> str:
    if difficulty == "hard":
        return {"cancel": "Hi, I'd like to cancel an order.",
                "return": "Hi, I want to return an order I received.",
                "status": "Hi, can you tell me the status of one of my orders?"}[intent]
    return {"cancel": f"Hi! Please cancel my order {order_id}, reason: {reason}. My email is {email}.",
            "return": f"Hi! Please return my delivered order {order_id}. My email is {email}.",
            "status": f"Hi! What is the status of my order {order_id}? My email is {email}."}[intent]


def _instruction(intent: str, difficulty: str, name: str, order_id: str, email: str, reason: str | None) -> str:
    goal = {"cancel": f"You want to cancel your order {order_id} because you "
                      f"{'no longer need it' if reason == 'no longer needed' else 'ordered it by mistake'} "
                      f"(the reason to give: '{reason}').",
            "return": f"You want to return your delivered order {order_id}.",
            "status": f"You want to know the status of your order {order_id}."}[intent]
    asked = "your email, the order id or the reason" if intent == "cancel" else "your email or the order id"
    reveal = (f"Give {asked.replace(' or ', ' and ')} in your first message." if difficulty == "easy" else
              f"At first say only what you want; give {asked} only when asked. "
              "If the agent asks you to confirm the action, answer 'yes'.")
    return f"You are {name}, email {email}. {goal} {reveal}"


def make_retail_tasks(n: int, seed: int, db: dict[str, Any], difficulty: str = "easy",
                      intents: tuple[str, ...] = INTENTS) -> list[dict[str, Any]]:
    """``n`` achievable tasks on ``db`` (dataset rows: JSON-serialisable dicts), seeded.

    Each row: ``task_id``, ``difficulty``, ``intent`` ("cancel" | "return" | "status"),
    ``order_id``, ``user_id``, ``email``, ``reason`` (a :data:`CANCEL_REASONS` entry for
    "cancel", else None), ``instruction`` (the user's goal in words, for an LLM user, τ-bench
    style), ``first_message`` (the scripted user's opening: the easy variant says intent, order id,
    reason and email; the hard one only the intent), ``gold_actions`` (``[{"name", "arguments"}]``:
    authenticate by email, then cancel / return / read the order), ``outputs`` (strings the agent
    must say: the order's status for "status", else empty), and ``db_seed`` / ``db_n_users`` /
    ``db_max_orders_per_user`` (how :class:`RetailEnv` rebuilds ``db``).

    Only goals reachable under the policy: "cancel" picks a pending order, "return" a delivered one,
    "status" any order. The intent of each task is drawn uniformly from ``intents`` among those
    the database allows.

    Args:
        n: number of tasks.
        seed: task sampling seed (independent of the database's).
        db: a pristine database of :func:`make_retail_db` (its ``meta`` gives the seed).
        difficulty: "easy" | "hard".
        intents: the intents to draw from.

    Raises:
        ValueError: a bad difficulty / intent, or none of ``intents`` is achievable on ``db``.
    """
    policy_for(difficulty)  # validates
    bad = [i for i in intents if i not in INTENTS]
    if bad or not intents:
        raise ValueError(f"intents must be a non-empty subset of {INTENTS}, got {intents}")
    rng = random.Random(seed)
    need = {"cancel": "pending", "return": "delivered", "status": None}
    pools = {i: sorted(o for o, order in db["orders"].items() if need[i] in (None, order["status"])) for i in intents}
    usable = [i for i in intents if pools[i]]
    if not usable:
        raise ValueError(f"no order of the database allows any of {intents}")
    meta = db["meta"]
    rows = []
    for k in range(n):
        intent = rng.choice(usable)
        order = db["orders"][rng.choice(pools[intent])]
        user = db["users"][order["user_id"]]
        reason = rng.choice(CANCEL_REASONS) if intent == "cancel" else None
        oid, email = order["order_id"], user["email"]
        gold = [{"name": "find_user_id_by_email", "arguments": {"email": email}}]
        gold.append({"cancel": {"name": "cancel_pending_order", "arguments": {"order_id": oid, "reason": reason}},
                     "return": {"name": "return_delivered_order", "arguments": {"order_id": oid}},
                     "status": {"name": "get_order_details", "arguments": {"order_id": oid}}}[intent])
        rows.append({
            "task_id": f"retail-{difficulty}-{meta['seed']}-{seed}-{k}", "difficulty": difficulty, "intent": intent,
            "order_id": oid, "user_id": user["user_id"], "email": email, "reason": reason,
            "instruction": _instruction(intent, difficulty, user["name"], oid, email, reason),
            "first_message": _first_message(intent, difficulty, oid, email, reason),
            "gold_actions": gold, "outputs": [order["status"]] if intent == "status" else [],
            "db_seed": meta["seed"], "db_n_users": meta["n_users"],
            "db_max_orders_per_user": meta["max_orders_per_user"],
        })
    return rows


def retail_stops(call_format: str = "hermes") -> tuple[str, ...]:
    """Stop strings of a tool turn in ``call_format`` (for :func:`arealite.env.tools.stop_at`)."""
    env = ToolEnv.__new__(RetailEnv)
    ToolEnv.__init__(env, make_retail_tools({"users": {}, "orders": {}, "products": {}}), call_format=call_format)
    return env.stops()


DEMO_SEED = 999_999  # database of the demonstrations (the tasks' databases use other seeds)
_YES_RE = re.compile(r"\s*yes\b", re.I)


class RetailEnv(ToolEnv):
    """One retail episode: the agent, the tools of :func:`make_retail_tools` on this episode's copy
    of the database, and a simulated customer (module docstring).

    Args:
        user_factory: ``fn(task) -> UserSimulator``, a fresh customer per episode.
        tool_timeout: seconds one tool call may run.
        tool_role: role of the tool-output message ("user" for SmolLM2's template).
        max_calls_per_turn: tool calls of one turn that run.
        strict_policy: reward 0 for an episode with a policy violation (default: violations are
            only counted).
        call_format: "hermes" (JSON ``<tool_call>``) or "tags" (``<tool>args</tool>``).
        demos: show :meth:`demonstrations` as earlier chat turns; ``demo_intents``: of these intents.

    Dataset rows are those of :func:`make_retail_tasks`. A model turn with a ``<tool_call>`` runs it;
    any other turn is a message to the customer, whose reply comes back as a "user" message; the
    customer's :data:`STOP` or ``transfer_to_human_agents`` ends the episode with :meth:`score`.

    ``info`` per step (the workflow sums them): ``tool_calls`` / ``tool_errors`` (of
    :class:`~arealite.env.tools.ToolEnv`), ``policy_violations`` (write calls on an existing order
    whose owner was not authenticated in this episode — found by email, or looked up by a user id
    the customer said — and, hard variant, write calls not right after the customer's explicit
    "yes"; a confirmation covers one write), ``user_turns`` (customer replies, :data:`STOP` included),
    and on the last step ``db_match`` (0/1). An episode cut by the workflow's turn limit gets reward 0.
    """

    def __init__(self, user_factory: Callable[[dict[str, Any]], UserSimulator], tool_timeout: float = 10.0,
                 tool_role: str = "user", max_calls_per_turn: int = 4, strict_policy: bool = False,
                 call_format: str = "hermes", demos: bool = False, demo_intents: tuple[str, ...] = INTENTS):
        super().__init__([], tool_timeout, tool_role, max_calls_per_turn, call_format)
        self.user_factory, self.strict_policy, self.demos = user_factory, strict_policy, demos
        self.demo_intents = tuple(demo_intents)

    async def areset(self, data: dict[str, Any]) -> list[dict[str, str]]:
        for key in ("db_seed", "gold_actions", "outputs", "difficulty", "order_id"):
            if key not in data:
                raise KeyError(f"dataset row has no {key!r} field; rows come from make_retail_tasks")
        self.task = data
        db_args = (data["db_seed"], data.get("db_n_users", 20), data.get("db_max_orders_per_user", 3))
        self.db = load_retail_db(*db_args)
        if data["order_id"] not in self.db["orders"]:
            raise ValueError(f"task {data.get('task_id')}: order {data['order_id']} is not in the database of "
                             f"seed {data['db_seed']}")
        self.goal_hash = db_hash(apply_actions(load_retail_db(*db_args), data["gold_actions"]))
        policy_for(data["difficulty"])  # validates
        self.hard = data["difficulty"] == "hard"
        self.authenticated: set[str] = set()
        self.agent_messages: list[str] = []
        self.user_messages: list[str] = []
        self.confirmed = False
        self.violations = 0
        self.transferred = False
        self.calls = []
        self.tools = make_retail_tools(self.db, self._on_lookup, self._on_write, self._on_transfer)
        self.tool_map = {t.name: t for t in self.tools}
        self.user = self.user_factory(data)
        first = await self.user.areset(data)
        self.user_messages.append(first)
        system = {"role": "system", "content": policy_for(data["difficulty"]) + "\n\n" + self.describe_tools()}
        return [system, *(self.demonstrations() if self.demos else []), {"role": "user", "content": first}]

    def demonstrations(self) -> list[dict[str, str]]:
        """Worked easy episodes (one per intent of ``demo_intents``) as earlier chat turns, on the database of seed
        :data:`DEMO_SEED` (not the tasks'): the customer's first message, each gold call in this
        environment's call format, the real tool outputs, the closing message. A 135M model writes
        tool calls only after demonstrations (docs/agents.md)."""
        db = load_retail_db(DEMO_SEED)
        tools = {t.name: t for t in make_retail_tools(db)}
        messages = []
        for task in [make_retail_tasks(1, DEMO_SEED + k, db, "easy", intents=(intent,))[0]
                     for k, intent in enumerate(self.demo_intents)]:
            messages.append({"role": "user", "content": task["first_message"]})
            for action in task["gold_actions"]:
                output = tools[action["name"]].fn(**action["arguments"])
                messages += [{"role": "assistant", "content": self.render_call(action["name"], action["arguments"])},
                             {"role": self.tool_role, "content": self.render_outputs([output])}]
            status = db["orders"][task["order_id"]]["status"]
            closing = {"cancel": f"Done: order {task['order_id']} is cancelled.",
                       "return": f"Done: the return of order {task['order_id']} is requested.",
                       "status": f"Your order {task['order_id']} is {status}."}[task["intent"]]
            messages.append({"role": "assistant", "content": closing})
        return messages

    # policy bookkeeping, called by the tools
    def _on_lookup(self, tool: str, user_id: str) -> None:
        if tool == "find_user_id_by_email" or any(user_id in m for m in self.user_messages):
            self.authenticated.add(user_id)

    def _on_write(self, tool: str, order: dict[str, Any]) -> None:
        unauthenticated = order["user_id"] not in self.authenticated
        unconfirmed = self.hard and not self.confirmed
        self.violations += int(unauthenticated or unconfirmed)
        self.confirmed = False  # one "yes" covers one write

    def _on_transfer(self, summary: str) -> None:
        self.transferred = True

    async def astep(self, completion: str) -> StepResult:
        before = self.violations
        step = await super().astep(completion)
        if self.transferred and not step.done:
            step = await self._finish(step.info)
        step.info["policy_violations"] = self.violations - before
        return step

    async def aon_text(self, completion: str) -> StepResult:
        self.agent_messages.append(completion)
        reply = await self.user.areply(completion)
        if STOP in reply:
            return await self._finish({"user_turns": 1})
        self.user_messages.append(reply)
        self.confirmed = bool(_YES_RE.match(reply))
        return StepResult(messages=[{"role": "user", "content": reply}], info={"user_turns": 1})

    async def _finish(self, info: dict[str, Any]) -> StepResult:
        reward = await self.score()
        return StepResult(reward=reward, done=True, info={**info, "db_match": int(self.db_matches())})

    def db_matches(self) -> bool:
        """The database equals the goal database (the pristine one with the task's gold actions applied)."""
        return db_hash(self.db) == self.goal_hash

    async def score(self) -> float:
        """τ-bench's reward: 1.0 iff :meth:`db_matches` and every string of the task's ``outputs``
        occurs (case-insensitive) in some agent message to the customer; else 0.0 (also 0.0 with
        ``strict_policy`` after a policy violation)."""
        said = [m.lower() for m in self.agent_messages]
        outputs_ok = all(any(o.lower() in m for m in said) for o in self.task["outputs"])
        ok = self.db_matches() and outputs_ok and not (self.strict_policy and self.violations)
        return float(ok)
