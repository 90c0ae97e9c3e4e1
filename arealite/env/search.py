"""A search agent's world: a seeded encyclopedia of fictional people and places, a BM25 index over
it (bm25s), a ``search`` tool shared by every episode of a process, and :class:`SearchEnv`.

The facts are generated, so the model cannot know them: a question is answerable only through the
tool (Search-R1, Jin et al. 2025, arXiv 2503.09516; ASearcher, Gao et al. 2025, arXiv 2508.07976).
Each person has one passage ("Velora Kint was a painter born in 1873 in the city of Drasmoor.") and
each city one ("Drasmoor is a city in Ostrelia, founded in 1204."). Questions:

- single hop: ``city`` ("In which city was Velora Kint born?"), ``year`` ("In what year was Velora Kint
  born?"), ``profession``;
- two hops: ``country`` ("In which country was Velora Kint born?"): the person's passage names the
  city, the city's passage names the country.

The agent calls ``search`` with Hermes ``<tool_call>`` blocks (:mod:`arealite.env.tools`) and ends
with ``<answer>...</answer>``; the reward is the exact match of the normalised answer (SQuAD's
normalisation: lower case, no punctuation, no articles), plus ``format_reward`` for an answer in
tags that is wrong.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import re
import string
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

from arealite.api.config import SearchTaskConfig
from arealite.api.env import StepResult
from arealite.env.tools import Tool, ToolEnv, ToolError

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "tr", "th",
           "sh", "gl", "pl", "qu"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou"]
_CODAS = ["", "", "", "n", "r", "s", "l"]
PROFESSIONS = ["painter", "sculptor", "poet", "chemist", "astronomer", "architect", "composer", "botanist",
               "cartographer", "physician", "engineer", "novelist", "historian", "violinist", "mathematician"]
QUESTION_KINDS = ("city", "year", "profession", "country")
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)).capitalize()


@dataclass
class Encyclopedia:
    """Generated facts and their passages.

    Attributes:
        people: ``{name: {"profession", "year", "city"}}``.
        cities: ``{name: {"country", "founded"}}``.
        passages: one text per person, then one per city (the search corpus).
    """

    people: dict[str, dict[str, Any]]
    cities: dict[str, dict[str, Any]]
    passages: list[str]

    @property
    def digest(self) -> str:
        """sha256 of the passages (names the index's cache folder)."""
        return hashlib.sha256("\n".join(self.passages).encode()).hexdigest()[:16]


def make_encyclopedia(seed: int = 0, n_people: int = 300, n_cities: int = 40, n_countries: int = 10) -> Encyclopedia:
    """A deterministic fictional encyclopedia (``random.Random(seed)``); names are unique.

    Raises:
        ValueError: a count < 1.
    """
    if min(n_people, n_cities, n_countries) < 1:
        raise ValueError(f"n_people, n_cities and n_countries must be >= 1, got {n_people}, {n_cities}, {n_countries}")
    rng, used = random.Random(seed), set()

    def unique(make):
        while True:
            name = make()
            if name not in used and name.lower() not in PROFESSIONS:
                used.add(name)
                return name

    countries = [unique(lambda: _word(rng, 2) + rng.choice(["ia", "and", "or", "ar"])) for _ in range(n_countries)]
    cities = {unique(lambda: _word(rng, 2)): {"country": rng.choice(countries), "founded": rng.randint(900, 1700)}
              for _ in range(n_cities)}
    city_names = list(cities)
    people = {unique(lambda: f"{_word(rng, rng.randint(1, 2))} {_word(rng, 2)}"):
              {"profession": rng.choice(PROFESSIONS), "year": rng.randint(1750, 1990), "city": rng.choice(city_names)}
              for _ in range(n_people)}
    passages = [f"{p} was {'an' if f['profession'][0] in 'aeiou' else 'a'} {f['profession']} born in {f['year']} in the city of {f['city']}." for p, f in people.items()]
    passages += [f"{c} is a city in {f['country']}, founded in {f['founded']}." for c, f in cities.items()]
    return Encyclopedia(people, cities, passages)


def in_split(person: str, split: str) -> bool:
    """Held-out people ("test") are a fixed fifth of all names (by a hash of the name, so the split
    does not depend on any seed); "train" is the rest."""
    held_out = int(hashlib.sha256(person.encode()).hexdigest(), 16) % 5 == 0
    return held_out if split == "test" else not held_out


def make_search_questions(enc: Encyclopedia, n: int | None = None, seed: int = 0,
                          kinds: tuple[str, ...] = QUESTION_KINDS, split: str | None = None) -> list[dict[str, Any]]:
    """``n`` dataset rows ``{"question", "answer", "kind", "person", "hops", "messages"}`` about distinct
    people of ``enc`` (of ``split``'s people, :func:`in_split`; None: all), cycling through ``kinds``;
    ``messages`` is the bare question as one user turn. ``n`` None: one per person.

    Raises:
        ValueError: an unknown kind or split, or ``n`` larger than the number of people.
    """
    bad = set(kinds) - set(QUESTION_KINDS)
    if bad or not kinds:
        raise ValueError(f"kinds must be a non-empty subset of {QUESTION_KINDS}, got {kinds}")
    if split not in (None, "train", "test"):
        raise ValueError(f"split must be 'train', 'test' or None, got {split!r}")
    pool = sorted(p for p in enc.people if split is None or in_split(p, split))
    n = len(pool) if n is None else n
    if n > len(pool):
        raise ValueError(f"n={n} questions need as many people; the {split or 'whole'} split has {len(pool)}")
    rng = random.Random(seed)
    rows = []
    for i, person in enumerate(rng.sample(pool, n)):
        kind, f = kinds[i % len(kinds)], enc.people[person]
        question, answer = {
            "city": (f"In which city was {person} born?", f["city"]),
            "year": (f"In what year was {person} born?", str(f["year"])),
            "profession": (f"What was {person}'s profession?", f["profession"]),
            "country": (f"In which country was {person} born?", enc.cities[f["city"]]["country"]),
        }[kind]
        rows.append({"question": question, "answer": answer, "kind": kind, "person": person,
                     "hops": 2 if kind == "country" else 1, "messages": [{"role": "user", "content": question}]})
    return rows


def load_search_questions(path, split: str = "train", size: int | None = None, seed: int = 0, *,
                          task: SearchTaskConfig | None = None) -> list[dict[str, Any]]:
    """A ``dataset_loader`` (:func:`arealite.trainer.rl_loop.run_rl`, bind ``task`` with
    :func:`functools.partial`): ``path`` "search" (or unset) = questions about the train or held-out
    people of the encyclopedia of ``task`` (a :class:`~arealite.api.config.SearchTaskConfig`; None:
    its defaults).

    Raises:
        ValueError: any other path.
    """
    if path not in (None, "", "search"):
        raise ValueError("the search agent's questions are generated: use path 'search' (or leave it unset)")
    task = task or SearchTaskConfig()
    enc = make_encyclopedia(task.seed, task.n_people, task.n_cities)
    return make_search_questions(enc, size, seed, tuple(task.kinds), split)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation (Rajpurkar et al. 2016, the official evaluation script): lower case, no
    punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def exact_match(prediction: str, gold: str) -> float:
    """1.0 if the normalised strings are equal, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str) -> float:
    """Token F1 of the normalised strings (SQuAD's), in [0, 1]."""
    p, g = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = sum((Counter(p) & Counter(g)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def extract_answer(text: str) -> str | None:
    """The last ``<answer>...</answer>`` of ``text`` (stripped), or None."""
    found = ANSWER_RE.findall(text)
    return found[-1].strip() if found else None


class BM25Index:
    """Okapi BM25 over ``passages`` with bm25s (Lù 2024, arXiv 2407.03618): Lucene's variant
    (Kamphuis et al. 2020), k1 = 1.5, b = 0.75, words of ≥ 2 letters, lower case, English stop words. Read-only once built, so any number of concurrent episodes share one.

    Args:
        passages: the corpus.
        cache_dir: if set, the index is saved there and loaded (not rebuilt) when the folder holds an
            index of the same passages.
    """

    def __init__(self, passages: list[str], cache_dir: str | None = None):
        import bm25s

        if not passages:
            raise ValueError("BM25Index needs at least one passage")
        self.passages = list(passages)
        self.loaded_from_cache = False
        if cache_dir and os.path.exists(os.path.join(cache_dir, "passages.json")):
            with open(os.path.join(cache_dir, "passages.json")) as f:
                if json.load(f) == self.passages:
                    self.retriever = bm25s.BM25.load(cache_dir)
                    self.loaded_from_cache = True
                    return
        self.retriever = bm25s.BM25()
        self.retriever.index(bm25s.tokenize(self.passages, stopwords="en", show_progress=False), show_progress=False)
        if cache_dir:
            os.makedirs(cache_dir, exist_ok=True)
            self.retriever.save(cache_dir)
            with open(os.path.join(cache_dir, "passages.json"), "w") as f:
                json.dump(self.passages, f)

    def search(self, query: str, k: int = 3) -> list[tuple[int, float]]:
        """The top ``min(k, len(passages))`` passages for ``query``: ``[(passage index, BM25 score)]``,
        best first; a query with no indexed word returns ``[]``."""
        import bm25s

        words = [w for w in bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)[0]
                 if w in self.retriever.vocab_dict]
        if not words:
            return []
        docs, scores = self.retriever.retrieve([words], k=min(k, len(self.passages)), show_progress=False, n_threads=1)
        return [(int(d), float(s)) for d, s in zip(docs[0], scores[0]) if s > 0]


_INDEXES: dict[str, BM25Index] = {}
_INDEX_LOCK = threading.Lock()


def shared_index(enc: Encyclopedia, cache_root: str | None = None) -> BM25Index:
    """The process's one index of ``enc`` (built on first use, under a lock; later calls and every
    episode get the same object). ``cache_root``: folder of on-disk indexes (``<root>/<digest>``), so a
    second process loads instead of building; default ``~/.cache/arealite/bm25``."""
    with _INDEX_LOCK:
        if enc.digest not in _INDEXES:
            root = cache_root or os.path.join(os.path.expanduser("~"), ".cache", "arealite", "bm25")
            _INDEXES[enc.digest] = BM25Index(enc.passages, os.path.join(root, enc.digest))
        return _INDEXES[enc.digest]


def search_tool(index: BM25Index, k: int = 3) -> Tool:
    """The ``search(query)`` tool: the top ``k`` passages, numbered ``[1] ...``, or "No results."."""

    async def search(query: str) -> str:
        if not isinstance(query, str) or not query.strip():
            raise ToolError("search needs a non-empty 'query' string")
        hits = await asyncio.to_thread(index.search, query, k)
        return "\n".join(f"[{i + 1}] {index.passages[d]}" for i, (d, _) in enumerate(hits)) or "No results."

    return Tool("search", "Search the encyclopedia; returns the most relevant passages.",
                {"type": "object", "properties": {"query": {"type": "string", "description": "what to look up"}},
                 "required": ["query"]}, search)


SYSTEM = "Answer questions about an encyclopedia you have never seen. Search it first."
# Two worked episodes, shown as earlier chat turns (SmolLM2-135M-Instruct follows the format after two,
# not after one or after a written instruction alone: 22 of 24 first turns searched vs 2 and 0).
DEMOS = (("In which city was Doru Vask born?", "Doru Vask",
          "[1] Doru Vask was a poet born in 1901 in the city of Bremor.", "Bremor"),
         ("In what year was Lina Pell born?", "Lina Pell",
          "[1] Lina Pell was a chemist born in 1822 in the city of Tosk.", "1822"))


def search_stops(call_format: str = "tags") -> tuple[str, ...]:
    """Stop strings of a search-agent turn: the end of a search call, or of the answer."""
    return ("</search>" if call_format == "tags" else "</tool_call>", "</answer>")


class SearchEnv(ToolEnv):
    """Question answering with the ``search`` tool (module docstring).

    Args:
        index: the shared BM25 index (:func:`shared_index`).
        k: passages per search.
        format_reward: reward of a wrong answer given in ``<answer>`` tags (0 in Search-R1).
        tool_timeout, tool_role, call_format: as :class:`~arealite.env.tools.ToolEnv` (default "tags":
            ``<search>query</search>``, Search-R1's; "hermes": JSON ``<tool_call>``).
        demos: show :data:`DEMOS` as earlier chat turns (a 135M model follows the format only then).

    Rows need ``question`` and ``answer`` (:func:`make_search_questions`). ``info`` adds ``answered``
    (an ``<answer>`` was given) and ``correct``; an answer is only read from a turn without a call.
    """

    def __init__(self, index: BM25Index, k: int = 3, format_reward: float = 0.0, tool_timeout: float = 10.0,
                 tool_role: str = "user", call_format: str = "tags", demos: bool = True):
        super().__init__([search_tool(index, k)], tool_timeout=tool_timeout, tool_role=tool_role,
                         call_format=call_format)
        self.format_reward, self.demos = format_reward, demos

    def prompt(self, question: str) -> list[dict[str, str]]:
        """The episode's first messages: system (task + tools), the demonstrations, the question."""
        messages = [{"role": "system", "content": SYSTEM + "\n\n" + self.describe_tools()}]
        for q, query, passage, answer in DEMOS if self.demos else ():
            messages += [{"role": "user", "content": "Question: " + q},
                         {"role": "assistant", "content": self.render_call("search", {"query": query})},
                         {"role": self.tool_role, "content": self.render_outputs([passage])},
                         {"role": "assistant", "content": f"<answer>{answer}</answer>"}]
        return messages + [{"role": "user", "content": "Question: " + question}]

    async def areset(self, data: dict[str, Any]) -> list[dict[str, str]]:
        for key in ("question", "answer"):
            if key not in data:
                raise KeyError(f"dataset row has no {key!r} field; rows need 'question' and 'answer' "
                               "(arealite.env.search.make_search_questions)")
        self.answer = str(data["answer"])
        return self.prompt(data["question"])

    async def aon_text(self, completion: str) -> StepResult:
        answer = extract_answer(completion)
        if answer is None:  # neither a call nor an answer: the episode ends unanswered
            return StepResult(reward=0.0, done=True, info={"answered": 0, "correct": 0})
        correct = exact_match(answer, self.answer)
        return StepResult(reward=correct or self.format_reward, done=True, info={"answered": 1, "correct": correct})
