"""Reward functions, reward specs and the Rubric scorer (timeouts, failures, concurrency, pickling)."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import cloudpickle
import pytest

from meshrl.errors import ConfigError
from meshrl.rewards import (
    REWARD_FNS,
    Rubric,
    ScoringConfig,
    char_match,
    exact,
    exact_match,
    format_reward,
    length_penalty,
    math_verify,
    parse_reward_spec,
    regex,
    resolve_reward,
)


def row(answer: str | None, **info) -> dict:
    return {**info, "prompt": "p", "answer": answer}


# --- built-in reward functions ----------------------------------------------------------------------------------

MATH_CASES = [
    # (gold, completion, reward)
    ("42", "\\boxed{42}", 1.0),
    ("Natalia sold 48/2 = 24 clips in May.\n48+24 = 72\n#### 72", "48 + 24 = 72 clips.\n#### 72", 1.0),
    ("1,234", "The total is 1234.", 1.0),
    ("1234", "So she pays $1,234$ dollars: \\boxed{1,234}", 1.0),
    ("\\frac{1}{2}", "The probability is 0.5", 1.0),
    ("\\frac12", "0.5", 1.0),
    ("0.5", "$\\frac{1}{2}$", 1.0),
    ("$\\sqrt{2}$", "The side is \\boxed{\\sqrt{2}}.", 1.0),
    ("\\sqrt{2}", "\\boxed{2^{1/2}}", 1.0),
    ("-3", "The answer is -3.", 1.0),
    ("\\frac{439}{7}", "The answer is 439/7.", 1.0),  # the full stop is not a decimal point (439/7.0 != 439/7)
    ("3.5", "It weighs 3.5.", 1.0),
    ("7", "The answer is 7.", 1.0),
    ("\\boxed{7}", "so x = 7", 1.0),
    ("42", "#### 42\nThat took 3 steps.", 1.0),  # prose after the GSM8K marker is not the answer
    ("3", "First 1, then 2, finally \\boxed{3}. Check: 5", 1.0),  # the boxed answer wins over later numbers
    ("42", "\\boxed{41}", 0.0),
    ("-3", "The answer is 3.", 0.0),
    ("42", "I do not know.", 0.0),
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}", 0.0),
]


@pytest.mark.parametrize(("gold", "completion", "expected"), MATH_CASES)
def test_math_verify_answer_formats(gold, completion, expected):
    assert math_verify(completion, row(gold)) == expected


def test_math_verify_needs_an_answer_and_refuses_huge_numbers():
    with pytest.raises(ValueError, match="needs the row's answer"):
        math_verify("\\boxed{1}", row(None))
    # Comparing these would hang the process inside sympy's big-integer code, holding the GIL: refused at once.
    for huge in ("\\boxed{9^{9^{9}}}", "\\boxed{(10^{10})!}", "\\boxed{(1+x)^{10000}}"):
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="too large"):
            math_verify(huge, row("42"))
        assert time.monotonic() - t0 < 5
    assert math_verify("\\boxed{2^{10}}", row("1024")) == 1.0  # ordinary powers still compare


def test_exact_match_and_char_match():
    assert exact_match("abc", row("abc")) == 1.0
    assert exact_match("abc ", row("abc")) == 0.0
    assert char_match("abcd", row("abcd")) == 1.0
    assert char_match("abxd", row("abcd")) == 0.75
    assert char_match("ab", row("abcd")) == 0.5  # too short
    assert char_match("abcdefgh", row("abcd")) == 0.5  # too long
    assert char_match("", row("")) == 1.0
    assert char_match("", row("ab")) == 0.0
    with pytest.raises(ValueError, match="answer"):
        char_match("a", row(None))


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("  42\n", "42", 1.0),
        ("so \\boxed{42}", "42", 1.0),
        ("\\boxed{\\frac{1}{2}} is it", "\\frac{1}{2}", 1.0),  # nested braces
        ("work...\n#### 42\nbye", "42", 1.0),
        ("#### 42", "long solution\n#### 42", 1.0),  # a GSM8K gold means its final answer
        ("\\boxed{41}", "42", 0.0),
        ("42.0", "42", 0.0),  # no maths here: see math_verify
    ],
)
def test_exact(completion, answer, expected):
    assert exact(completion, row(answer)) == expected


def test_regex_with_and_without_a_group():
    cfg = ScoringConfig()
    assert regex("Thinking...\nAnswer: 42", row("42"), cfg=cfg) == 1.0
    assert regex("answer = 42  \nthanks", row("42"), cfg=cfg) == 1.0
    assert regex("Answer: 41\nwait, Answer: 42", row("42"), cfg=cfg) == 1.0  # the last one counts
    assert regex("Answer: 41", row("42"), cfg=cfg) == 0.0
    assert regex("42", row("42"), cfg=cfg) == 0.0  # no match
    no_group = ScoringConfig(regex=r"\bDONE\b")
    assert regex("all DONE", row(None), cfg=no_group) == 1.0
    assert regex("undone", row(None), cfg=no_group) == 0.0


def test_format_and_length_penalty():
    assert format_reward("<think>2+2=4</think>\n4", row(None)) == 1.0
    assert format_reward("  <think>a\nb</think>The answer is 4.\n", row(None)) == 1.0
    for bad in (
        "4",
        "<think>x</think>",
        "<think></think>4",
        "<think>a</think>4<think>b</think>",
        "pre<think>a</think>4",
    ):
        assert format_reward(bad, row(None)) == 0.0, bad
    cfg = ScoringConfig(length_target=10)
    assert length_penalty("x" * 10, row(None), cfg=cfg) == 0.0
    assert length_penalty("x" * 15, row(None), cfg=cfg) == -0.5
    assert length_penalty("x" * 100, row(None), cfg=cfg) == -1.0


# --- specs, names, config ---------------------------------------------------------------------------------------


def test_parse_reward_spec():
    assert parse_reward_spec("math_verify=1.0,format=0.1") == {"math_verify": 1.0, "format": 0.1}
    assert parse_reward_spec(" exact ,  length_penalty = -0.5 ") == {"exact": 1.0, "length_penalty": -0.5}
    assert parse_reward_spec("my_pkg.my_mod:fn=0.5") == {"my_pkg.my_mod:fn": 0.5}
    assert parse_reward_spec("format=0") == {"format": 0.0}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "empty reward spec"),
        ("  ", "empty reward spec"),
        ("exact=1,,format", "empty item"),
        ("exact=1,", "empty item"),
        ("exact=high", "'exact=high'.*'high' is not a finite number"),
        ("exact=", "'exact='.*not a finite number"),
        ("exact=nan", "not a finite number"),
        ("=0.5", "no function name"),
        ("exact=1,exact=2", "names 'exact' twice"),
    ],
)
def test_parse_reward_spec_errors(spec, message):
    with pytest.raises(ConfigError, match=message) as e:
        parse_reward_spec(spec)
    if "twice" not in message:
        assert "name=weight" in str(e.value)  # shows the expected form


def test_resolve_reward(tmp_path, monkeypatch):
    assert resolve_reward("math_verify") is REWARD_FNS["math_verify"]
    fn = resolve_reward("user_rewards:contains_answer")
    assert fn("it is 42", row("42")) == 1.0
    assert resolve_reward("user_rewards:Judges.strict")("a", row("a")) == 1.0

    with pytest.raises(ConfigError, match=r"unknown reward function 'nope'.*registered.*math_verify.*module:function"):
        resolve_reward("nope")
    with pytest.raises(ConfigError, match="did you mean 'user_rewards:contains_answer'"):
        resolve_reward("user_rewards.contains_answer")
    with pytest.raises(ConfigError, match="no module named 'no_such_pkg'.*PYTHONPATH"):
        resolve_reward("no_such_pkg.mod:fn")
    with pytest.raises(ConfigError, match="has no 'missing'.*contains_answer"):
        resolve_reward("user_rewards:missing")
    with pytest.raises(ConfigError, match="not callable .*type int"):
        resolve_reward("user_rewards:NOT_A_FUNCTION")

    (tmp_path / "broken_rewards.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="importing 'broken_rewards' failed.*no_such_dependency_xyz"):
        resolve_reward("broken_rewards:fn")


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"timeout_s": 0}, "--scoring.timeout-s"),
        ({"timeout_s": math.inf}, "--scoring.timeout-s"),
        ({"num_procs": 0}, "--scoring.num-procs"),
        ({"num_threads": 0}, "--scoring.num-threads"),
        ({"length_target": 0}, "--scoring.length-target"),
        ({"regex": "(unclosed"}, "--scoring.regex"),
        ({"format_pattern": "[z-a]"}, "--scoring.format-pattern"),
    ],
)
def test_scoring_config_errors_name_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        ScoringConfig(**kwargs)


def test_reward_set_checks_at_construction():
    with pytest.raises(ConfigError, match="unknown reward function"):
        Rubric({"exact": 1.0, "nope": 1.0})
    with pytest.raises(ConfigError, match="finite"):
        Rubric({"exact": math.nan})
    with pytest.raises(ConfigError, match="not callable"):
        Rubric({"mine": 1.0}, fns={"mine": 3})
    with pytest.raises(ConfigError, match="no weight"):
        Rubric({"exact": 1.0}, fns={"other": lambda c, r: 1.0})


# --- Rubric scoring ------------------------------------------------------------------------------------------


def test_weighted_sum_and_cfg_binding():
    rs = Rubric(parse_reward_spec("math_verify=1.0,format=0.1,length_penalty=0.5"), ScoringConfig(length_target=20))
    try:
        good = "<think>2+2</think> \\boxed{4}"  # 28 characters: 8 past the target
        [s1, s2] = rs.score([good, "5"], [row("4"), row("4")])
        assert s1.parts == {"math_verify": 1.0, "format": 1.0, "length_penalty": -0.4}
        assert s1.reward == pytest.approx(1.0 + 0.1 - 0.5 * 0.4) and not s1.failures
        assert s2.reward == 0.0 and s2.parts == {"math_verify": 0.0, "format": 0.0, "length_penalty": 0.0}
        assert rs.names == ["math_verify", "format", "length_penalty"]
        assert rs.weights == {"math_verify": 1.0, "format": 0.1, "length_penalty": 0.5}
        with pytest.raises(ValueError, match="2 completions but 1 rows"):
            rs.score(["a", "b"], [row("a")])
        assert rs.score([], []) == []
    finally:
        rs.close()


def test_user_functions_with_a_cfg_keyword_get_the_run_config():
    rs = Rubric({"user_rewards:long_enough": 1.0, "user_rewards:contains_answer": 1.0}, ScoringConfig(length_target=3))
    try:
        assert [s.parts for s in rs.score(["42", "4242"], [row("42")] * 2)] == [
            {"user_rewards:long_enough": 0.0, "user_rewards:contains_answer": 1.0},
            {"user_rewards:long_enough": 1.0, "user_rewards:contains_answer": 1.0},
        ]
    finally:
        rs.close()


def test_failures_are_zero_and_counted():
    def boom(completion, row):
        raise RuntimeError("verifier crashed")

    fns = {"boom": boom, "text": lambda c, r: "1", "nan": lambda c, r: math.nan, "none": lambda c, r: None}
    rs = Rubric({"exact": 1.0, **dict.fromkeys(fns, 1.0)}, fns=fns)
    try:
        [s] = rs.score(["42"], [row("42")])
    finally:
        rs.close()
    assert s.parts == {"exact": 1.0, "boom": 0.0, "text": 0.0, "nan": 0.0, "none": 0.0}
    assert s.reward == 1.0  # the healthy function still counts
    assert s.failures["boom"] == "error: RuntimeError: verifier crashed"
    assert s.failures["text"].startswith("error: TypeError") and "str" in s.failures["text"]
    assert s.failures["nan"].startswith("error: ValueError") and "nan" in s.failures["nan"]
    assert s.failures["none"].startswith("error: TypeError")
    assert set(s.failures) == {"boom", "text", "nan", "none"}


def test_math_verify_errors_are_counted():
    rs = Rubric({"math_verify": 1.0})
    try:
        [s] = rs.score(["\\boxed{1}"], [row(None)])
    finally:
        rs.close()
    assert s.reward == 0.0 and s.failures == {"math_verify": "error: ValueError: math_verify needs the row's answer"}


def test_hung_functions_time_out_without_serialising_and_the_pool_recovers():
    release = threading.Event()  # lets the abandoned threads go at the end of the test

    def hang(completion, row):
        if completion.startswith("hang"):
            release.wait(60)
        return 1.0

    rs = Rubric({"hang": 1.0, "exact_match": 1.0}, ScoringConfig(timeout_s=0.5, num_threads=4), fns={"hang": hang})
    try:
        completions = ["hang"] * 4 + ["ok"] * 4
        t0 = time.monotonic()
        out = rs.score(completions, [row("ok")] * 8)
        took = time.monotonic() - t0
        # 4 hung samples on 4 threads: their deadlines run side by side, then the 4 others run on a fresh pool.
        assert took < 2.5, took
        assert [s.failures.get("hang") for s in out] == ["timeout"] * 4 + [None] * 4
        assert [s.reward for s in out] == [0.0] * 4 + [2.0] * 4
        assert [s.parts["exact_match"] for s in out] == [0.0] * 4 + [1.0] * 4  # the other function still ran

        # The next batch gets a full pool: 4 more hung samples again time out together.
        t0 = time.monotonic()
        out = rs.score(["hang"] * 4, [row("ok")] * 4)
        assert time.monotonic() - t0 < 2.0
        assert all(s.failures == {"hang": "timeout"} for s in out)
        assert [s.reward for s in rs.score(["ok"] * 8, [row("ok")] * 8)] == [2.0] * 8
    finally:
        release.set()
        rs.close()


def test_time_sleep_hang_times_out():
    rs = Rubric({"sleepy": 1.0}, ScoringConfig(timeout_s=0.5), fns={"sleepy": lambda c, r: time.sleep(60) or 1.0})
    t0 = time.monotonic()
    [s] = rs.score(["x"], [row(None)])
    assert time.monotonic() - t0 < 2.0
    assert s.reward == 0.0 and s.failures == {"sleepy": "timeout"}
    rs.close()  # the sleeping daemon thread is abandoned; it cannot delay interpreter exit


def test_deadline_counts_from_the_start_of_each_sample():
    # 12 samples of 0.3 s on 2 threads take ~1.8 s in all, but each stays well inside its own 1 s.
    rs = Rubric(
        {"slow": 1.0}, ScoringConfig(timeout_s=1.0, num_threads=2), fns={"slow": lambda c, r: time.sleep(0.3) or 1.0}
    )
    try:
        out = rs.score(["x"] * 12, [row(None)] * 12)
    finally:
        rs.close()
    assert [s.failures for s in out] == [{}] * 12
    assert [s.reward for s in out] == [1.0] * 12


def test_async_reward_functions():
    async def slow_judge(completion, row):
        await asyncio.sleep(0.1)
        return float(completion == row["answer"])

    async def stuck(completion, row):
        await asyncio.sleep(60)
        return 1.0

    async def raises_timeout(completion, row):
        raise TimeoutError("upstream judge timed out")

    rs = Rubric(
        {"judge": 1.0, "stuck": 1.0, "raises": 1.0, "user_rewards:async_contains_answer": 0.5},
        ScoringConfig(timeout_s=0.5, num_threads=4),
        fns={"judge": slow_judge, "stuck": stuck, "raises": raises_timeout},
    )
    try:
        t0 = time.monotonic()
        out = rs.score(["a", "b", "a"], [row("a")] * 3)
        assert time.monotonic() - t0 < 2.5
    finally:
        rs.close()
    assert [s.parts["judge"] for s in out] == [1.0, 0.0, 1.0]
    assert [s.reward for s in out] == [1.5, 0.0, 1.5]
    assert all(s.failures["stuck"] == "timeout" for s in out)
    assert all(s.failures["raises"].startswith("error: TimeoutError") for s in out)  # its own error, not ours


def test_cloudpickle_round_trip_with_closures():
    bonus = 0.25

    def closure(completion, row):
        return bonus * len(completion)

    rs = Rubric(
        {"exact": 1.0, "user_rewards:contains_answer": 1.0, "lam": 1.0, "closure": 1.0, "length_penalty": 1.0},
        ScoringConfig(length_target=2, num_threads=2),
        fns={"lam": lambda c, r: 0.5, "closure": closure},
    )
    before = rs.score(["42"], [row("42")])  # starts the threads, which must not travel
    copy = cloudpickle.loads(cloudpickle.dumps(rs))
    rs.close()
    try:
        assert copy._pool is None
        assert copy.cfg == rs.cfg and copy.weights == rs.weights
        after = copy.score(["42", "4242"], [row("42"), row("42")])
        assert after[0] == before[0]
        assert after[0].parts == {
            "exact": 1.0,
            "user_rewards:contains_answer": 1.0,
            "lam": 0.5,
            "closure": 0.5,
            "length_penalty": 0.0,
        }
        assert after[1].parts["length_penalty"] == -1.0  # the pickled cfg (length_target=2) came along
    finally:
        copy.close()


def test_threads_overlap_io_bound_functions():
    rs = Rubric({"io": 1.0}, ScoringConfig(num_threads=8), fns={"io": lambda c, r: time.sleep(0.2) or 1.0})
    try:
        t0 = time.monotonic()
        out = rs.score(["x"] * 16, [row(None)] * 16)
        took = time.monotonic() - t0
    finally:
        rs.close()
    assert [s.reward for s in out] == [1.0] * 16
    assert took < 1.5, took  # serial: 3.2 s; 8 threads: ~0.4 s


# ---- group rewards: one call per group of completions sampled for the same row -------------------------------


def test_group_reward_sees_each_group_whole_beside_per_sample_functions():
    from meshrl.rewards import Rubric, ScoringConfig, group_reward

    seen = []

    @group_reward
    def rank(completions: list[str], row: dict) -> list[float]:
        seen.append((tuple(completions), row["answer"]))
        return [float(len(completions) - i) for i in range(len(completions))]

    rs = Rubric({"rank": 0.5, "exact_match": 1.0}, ScoringConfig(num_threads=2), fns={"rank": rank})
    completions = ["a", "b", "c", "x", "y", "z"]
    rows = [{"prompt": "p", "answer": "a"}] * 3 + [{"prompt": "q", "answer": "z"}] * 3
    out = rs.score(completions, rows, group_size=3)
    assert sorted(seen) == [(("a", "b", "c"), "a"), (("x", "y", "z"), "z")]
    assert [s.parts["rank"] for s in out] == [3.0, 2.0, 1.0] * 2
    assert [s.parts["exact_match"] for s in out] == [1, 0, 0, 0, 0, 1]
    assert out[0].reward == 1.0 + 0.5 * 3.0 and not any(s.failures for s in out)
    with pytest.raises(ValueError, match="groups of 4"):
        rs.score(completions, rows, group_size=4)


def test_group_reward_failures_score_the_whole_group_zero():
    from meshrl.rewards import Rubric, ScoringConfig, group_reward

    @group_reward
    def wrong_length(completions, row):
        return [1.0]

    @group_reward
    def hangs(completions, row):
        time.sleep(30)
        return [1.0] * len(completions)

    rs = Rubric(
        {"wrong_length": 1.0, "hangs": 1.0, "exact_match": 1.0},
        ScoringConfig(num_threads=4, timeout_s=0.5),
        fns={"wrong_length": wrong_length, "hangs": hangs},
    )
    t0 = time.monotonic()
    out = rs.score(["a", "b"], [{"prompt": "p", "answer": "a"}] * 2, group_size=2)
    assert time.monotonic() - t0 < 5
    assert all(s.failures["wrong_length"].startswith("error: ValueError") for s in out)
    assert all(s.failures["hangs"] == "timeout" for s in out)
    assert [s.reward for s in out] == [1.0, 0.0]  # exact_match still scored


def test_a_reward_written_for_the_earlier_contract_is_refused_at_launch():
    """fn(completion, answer: str) given the row dict scored 0 on every sample, silently (issue 31, item 1): refused
    when the rubric is built, naming the function and the contract."""
    with pytest.raises(
        ConfigError, match=r"user_rewards:old_contract.*second parameter is `answer: str`.*row\['answer'\]"
    ):
        Rubric({"user_rewards:old_contract": 1.0})

    def positional_answer(completion, answer):
        return 0.0

    def one_argument(completion):
        return 0.0

    with pytest.raises(ConfigError, match="second parameter is `answer`"):
        Rubric({"mine": 1.0}, fns={"mine": positional_answer})
    with pytest.raises(
        ConfigError, match=r"takes \(completion\); a reward function is fn\(completion: str, row: dict\)"
    ):
        Rubric({"mine": 1.0}, fns={"mine": one_argument})
    Rubric({"ok": 1.0, "kw": 1.0}, fns={"ok": lambda c, row: 0.0, "kw": lambda *a, **k: 0.0})  # both follow it


def test_score_refuses_token_ids_or_answer_strings():
    """Controller.score(token_ids, answer_strings) scored 0 with an AttributeError per sample: refused instead."""
    rubric = Rubric({"exact_match": 1.0})
    with pytest.raises(TypeError, match="completions must be a list of str .*decode token ids.*got list"):
        rubric.score([[1, 2, 3]], [{"answer": "x"}])
    with pytest.raises(TypeError, match="rows must be a list of row dicts.*got str"):
        rubric.score(["x"], ["x"])


def test_eval_says_its_verifier_and_warns_when_no_answer_is_math(capsys):
    """Data rows without --reward are judged by math_verify: letter answers all scored 0.000, silently (issue 31,
    item 8). The verifier is named at launch, and answers that do not read as math are warned about."""
    from meshrl.rewards import math_parseable
    from meshrl.tasks.base import Row, Task
    from meshrl.tasks.setup import _say_the_verifier

    assert math_parseable(["42", "\\frac12", "x + 1"]) == 3 and math_parseable(["B", "C", None]) == 0
    letters = Task("data", [], [Row("q", answer=a) for a in "BCAD"], reward="math_verify=1.0", verifier="")
    _say_the_verifier(letters, "math_verify", None)
    said = capsys.readouterr()
    assert "verifier: math_verify (the task's default" in said.out
    assert "none of the 4 held-out answers checked (e.g. 'B', 'C', 'A') reads as math" in said.err
    numbers = Task("data", [], [Row("q", answer="12")], reward="math_verify=1.0", verifier="")
    _say_the_verifier(numbers, "math_verify", "math_verify=1")
    said = capsys.readouterr()
    assert said.out == "[meshrl] verifier: math_verify\n" and said.err == ""
