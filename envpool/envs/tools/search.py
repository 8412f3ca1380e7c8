"""Search-R1's retrieval game, fully offline: answer a question by searching a small corpus.

The protocol is Search-R1's (Jin et al. 2025, "Search-R1: Training LLMs to Reason and Leverage
Search Engines with Reinforcement Learning", arXiv:2503.09516). Each turn the model replies with
one of two tags; the first complete tag in the reply decides:

- `<search>query</search>`: the environment answers
  `<information>Doc 1(Title: T) text\\nDoc 2(Title: T) text ...</information>` with the `topk`
  (default 3) best passages by BM25, each cut to `passage_chars` characters so the observation
  stays short (at most 540 characters for three from the shipped corpus). Reward 0, the episode
  goes on. At most `max_searches` (default 3) searches: a later one is answered with
  `valid=False`, the format penalty and a reminder to answer, and changes nothing.
- `<answer>text</answer>`: the episode ends. Reward 1.0 when the answer equals one of the gold
  answers after SQuAD-style normalisation (lowercase, no punctuation, no articles "a/an/the",
  single spaces), else 0.0. `success` says the same.
- Neither tag (or an empty query): `valid=False`, reward `format_penalty` (default -0.1), the
  state is unchanged and the episode goes on; the observation names both tags (Search-R1's
  "my previous action is invalid" hint).

The corpus (`data/search_corpus.jsonl`, {"id","title","text"}) describes ~200 fictional towns,
people, inventions, rivers and mountains, so a model cannot answer from memory; the questions
(`data/search_questions.jsonl`, {"question","answers","gold_ids"}) are half one-hop and half
two-hop ("In which town was the inventor of the tide compass born?" needs the invention's
passage, then the inventor's). The seed picks the question (`random.Random(seed)`).

Retrieval is Okapi BM25 (k1=1.2, b=0.75, Lucene's non-negative idf, lowercase alphanumeric word
tokens, each distinct query word counted once, ties broken by corpus order) in pure Python. The
index is built once per process per corpus file, lazily, and shared by every episode.

Anchor: `q<question index>|s<searches used>|<sorted ids of the passages shown so far>`, e.g.
`q17|s2|i26,p78,t03`. It is what the policy has seen (the question and the set of passages; the
order and wording of the queries that found them do not matter) plus the searches left, which
decide whether another search is legal. After the answer the anchor is `q<index>|answered`.
"""

from __future__ import annotations

import json
import math
import random
import re
import string
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from millstream.envpool.envs.base import Observation, StepResult, register

__all__ = [
    "SearchEnv",
    "BM25",
    "load_corpus",
    "load_questions",
    "normalize_answer",
    "DEFAULT_CORPUS",
    "DEFAULT_QUESTIONS",
]

DATA_DIR = Path(__file__).resolve().parent.parent / "data"  # envpool/envs/data
DEFAULT_CORPUS = DATA_DIR / "search_corpus.jsonl"
DEFAULT_QUESTIONS = DATA_DIR / "search_questions.jsonl"

_WORD = re.compile(r"[a-z0-9]+")
# The first complete <search> or <answer> block decides, as in Search-R1's postprocess_predictions.
_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.S)
_INVALID = (
    "Invalid reply. To search, put the query between <search> and </search>. To give the "
    "final answer, put it between <answer> and </answer>."
)


def tokenize(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lowercase, drop punctuation and articles, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


@dataclass(frozen=True)
class Passage:
    id: str
    title: str
    text: str


class BM25:
    """Okapi BM25 over a fixed list of passages (title and text are indexed together)."""

    def __init__(self, passages: list[Passage], k1: float = 1.2, b: float = 0.75) -> None:
        self.passages = passages
        self.k1, self.b = k1, b
        term_counts = [Counter(tokenize(f"{p.title} {p.text}")) for p in passages]
        self.lengths = [sum(c.values()) for c in term_counts]
        self.avg_length = sum(self.lengths) / max(len(passages), 1)
        # Inverted index: word -> [(passage index, term frequency)], so a query only touches the
        # passages that share a word with it.
        self.postings: dict[str, list[tuple[int, int]]] = {}
        for index, counts in enumerate(term_counts):
            for term, tf in counts.items():
                self.postings.setdefault(term, []).append((index, tf))
        n = len(passages)
        self.idf = {
            term: math.log((n - len(post) + 0.5) / (len(post) + 0.5) + 1.0)
            for term, post in self.postings.items()
        }

    def scores(self, query: str) -> dict[int, float]:
        scores: dict[int, float] = {}
        for term in set(tokenize(query)):
            idf = self.idf.get(term)
            if idf is None:
                continue
            for index, tf in self.postings[term]:
                norm = self.k1 * (1 - self.b + self.b * self.lengths[index] / self.avg_length)
                scores[index] = scores.get(index, 0.0) + idf * tf * (self.k1 + 1) / (tf + norm)
        return scores

    def search(self, query: str, k: int) -> list[Passage]:
        """The `k` best passages sharing at least one word with the query, best first."""
        ranked = sorted(self.scores(query).items(), key=lambda item: (-item[1], item[0]))
        return [self.passages[index] for index, _ in ranked[:k]]


def _read_jsonl(path: Path, arg: str) -> list[dict]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"{arg}={str(path)!r} cannot be read: {exc.strerror}") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{arg}={str(path)!r}: line {number} is not JSON") from None
        if not isinstance(row, dict):
            raise ValueError(f"{arg}={str(path)!r}: line {number} is not a JSON object")
        rows.append(row)
    if not rows:
        raise ValueError(f"{arg}={str(path)!r} holds no rows")
    return rows


# One index per corpus file and process: thousands of concurrent episodes share it.
_INDEXES: dict[Path, BM25] = {}
_QUESTIONS: dict[Path, list[dict]] = {}


def load_corpus(path: str | Path = DEFAULT_CORPUS) -> BM25:
    """The BM25 index of a corpus file, built on first use and cached by resolved path."""
    key = Path(path).resolve()
    if key not in _INDEXES:
        passages = []
        for number, row in enumerate(_read_jsonl(key, "corpus_path"), 1):
            if not all(isinstance(row.get(f), str) for f in ("id", "title", "text")):
                raise ValueError(f"corpus_path={str(path)!r}: row {number} needs string id, title, text")
            passages.append(Passage(row["id"], row["title"], row["text"]))
        if len({p.id for p in passages}) != len(passages):
            raise ValueError(f"corpus_path={str(path)!r}: passage ids are not unique")
        _INDEXES[key] = BM25(passages)
    return _INDEXES[key]


def load_questions(path: str | Path = DEFAULT_QUESTIONS) -> list[dict]:
    """The questions of a file, checked ({"question", "answers": [...], "gold_ids": [...]})."""
    key = Path(path).resolve()
    if key not in _QUESTIONS:
        rows = _read_jsonl(key, "questions_path")
        for number, row in enumerate(rows, 1):
            answers = row.get("answers")
            if (
                not isinstance(row.get("question"), str)
                or not isinstance(answers, list)
                or not answers
                or not all(isinstance(a, str) and normalize_answer(a) for a in answers)
            ):
                raise ValueError(
                    f"questions_path={str(path)!r}: row {number} needs a question and "
                    "a non-empty list of answers"
                )
            gold = row.setdefault("gold_ids", [])
            if not isinstance(gold, list) or not all(isinstance(g, str) for g in gold):
                raise ValueError(
                    f"questions_path={str(path)!r}: row {number}: gold_ids must be a list of ids"
                )
        _QUESTIONS[key] = rows
    return _QUESTIONS[key]


@register("search")
class SearchEnv:
    system_prompt = (
        "Answer the question. Think inside <think></think>. To look something up, write "
        "<search>query</search>; results come back inside <information></information>. "
        "When you know the answer, write <answer>answer</answer> with the answer only."
    )

    def __init__(
        self,
        corpus_path: str | None = None,
        questions_path: str | None = None,
        topk: int = 3,
        max_searches: int = 3,
        passage_chars: int = 160,
        format_penalty: float = -0.1,
    ) -> None:
        if not isinstance(topk, int) or topk < 1:
            raise ValueError(f"topk must be an integer >= 1, got {topk!r}")
        if not isinstance(max_searches, int) or max_searches < 0:
            raise ValueError(f"max_searches must be an integer >= 0, got {max_searches!r}")
        if not isinstance(passage_chars, int) or passage_chars < 20:
            raise ValueError(f"passage_chars must be an integer >= 20, got {passage_chars!r}")
        self.index = load_corpus(corpus_path or DEFAULT_CORPUS)
        self.questions = load_questions(questions_path or DEFAULT_QUESTIONS)
        known = {p.id for p in self.index.passages}
        for number, row in enumerate(self.questions, 1):
            missing = [g for g in row["gold_ids"] if g not in known]
            if missing:
                raise ValueError(
                    f"questions_path={questions_path!r}: row {number} names gold ids "
                    f"{missing} that are not in corpus_path={corpus_path!r}"
                )
        self.topk, self.max_searches, self.passage_chars = topk, max_searches, passage_chars
        self.format_penalty = format_penalty
        self._question = -1
        self._searches = 0
        self._seen: set[str] = set()
        self._done = False

    @property
    def question(self) -> dict:
        return self.questions[self._question]

    def _anchor(self) -> str:
        if self._done:
            return f"q{self._question}|answered"
        return f"q{self._question}|s{self._searches}|{','.join(sorted(self._seen))}"

    def _obs(self, text: str) -> Observation:
        return Observation(text, anchor=self._anchor())

    def _invalid(self, text: str, reason: str) -> StepResult:
        return StepResult(
            self._obs(text), self.format_penalty, False, {"valid": False, "success": False, "reason": reason}
        )

    def _format(self, passages: list[Passage]) -> str:
        # Search-R1's _passages2string: "Doc i(Title: title) text", one per line.
        lines = []
        for i, p in enumerate(passages, 1):
            text = p.text if len(p.text) <= self.passage_chars else p.text[: self.passage_chars - 3] + "..."
            lines.append(f"Doc {i}(Title: {p.title}) {text}")
        return "<information>" + ("\n".join(lines) or "No results.") + "</information>"

    async def reset(self, seed: int) -> Observation:
        self._question = random.Random(seed).randrange(len(self.questions))
        self._searches, self._seen, self._done = 0, set(), False
        return self._obs(f"Question: {self.question['question']}")

    async def step(self, action: str) -> StepResult:
        if self._done:
            raise RuntimeError("step() after the episode ended; call reset() first")
        match = _ACTION.search(action)
        if match is None:
            return self._invalid(_INVALID, "no_tag")
        tag, content = match.group(1), match.group(2).strip()
        if tag == "answer":
            gold = {normalize_answer(a) for a in self.question["answers"]}
            correct = normalize_answer(content) in gold
            self._done = True
            return StepResult(
                self._obs(""),
                1.0 if correct else 0.0,
                True,
                {"valid": True, "success": correct, "searches": self._searches},
            )
        if not tokenize(content):
            return self._invalid(_INVALID, "empty_query")
        if self._searches >= self.max_searches:
            return self._invalid(
                f"You have used all {self.max_searches} searches. Now give the final "
                "answer inside <answer> and </answer>.",
                "search_limit",
            )
        passages = self.index.search(content, self.topk)
        self._searches += 1
        self._seen.update(p.id for p in passages)
        gold = set(self.question["gold_ids"])
        info = {
            "valid": True,
            "success": False,
            "searches": self._searches,
            "gold_found": len(gold & self._seen),
            "gold_needed": len(gold),
        }
        return StepResult(self._obs(self._format(passages)), 0.0, False, info)
