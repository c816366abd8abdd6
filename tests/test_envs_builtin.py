"""The built-in environments (meshrl.envs.calculator, meshrl.envs.guess_number) played on text, without a model:
the calculator's safe evaluation and tool-call parsing, whole episodes driven by each environment's own
demonstration, wrong answers, bad guesses, and the built-in rows (deterministic; calculator splits disjoint)."""

from __future__ import annotations

import math

import pytest

from meshrl.envs.calculator import (
    INSTRUCTION,
    CalculatorEnv,
    ToolCall,
    ToolError,
    format_number,
    last_number,
    parse_tool_call,
    safe_eval,
)
from meshrl.envs.guess_number import GuessNumberEnv, binary_search_guesses
from meshrl.errors import ConfigError
from meshrl.rollout.environment import play
from meshrl.tasks.base import Row

# --- safe_eval ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expr,value",
    [
        ("17*23", 391),
        (" 45 + 38 ", 83),
        ("83-27", 56),
        ("-(3+4)*2", -14),
        ("+5", 5),
        ("2**10", 1024),
        ("2**-1", 0.5),
        ("7//2", 3),
        ("7%3", 1),
        ("6/3", 2),
        ("1.5*4", 6),
        ("((1+2)*(3+4))", 21),
        ("(" * 99 + "1" + ")" * 99, 1),
        ("-" * 199 + "1", -1),
    ],
)
def test_safe_eval_accepts_arithmetic(expr, value):
    result = safe_eval(expr)
    assert result == value
    if float(value).is_integer():
        assert type(result) is int  # integral results print as integers


@pytest.mark.parametrize(
    "expr,says",
    [
        ("__import__('os')", "not allowed"),
        ("a+1", "names"),
        ("abs(-1)", "not allowed"),
        ("(1).real", "attributes"),
        ("2**100000", "exponent"),
        ('"x"*3', "strings"),
        ("1/0", "division by zero"),
        ("5%0", "division by zero"),
        ("1 < 2", "comparisons"),
        ("True+1", "not allowed"),
        ("2^3", "use **"),
        ("~1", "not allowed"),
        ("1,000", "tuples"),
        ("(-8)**0.5", "real number"),
        ("99999999**2", "too large"),
        ("10**10*10**10", "too large"),
        ("1" * 20, "too large"),
        ("1+" * 150 + "1", "too long"),
        ("17*", "not a valid expression"),
        ("", "empty"),
        ("(" * 100 + "1" + ")" * 100, "too long"),
    ],
)
def test_safe_eval_refuses(expr, says):
    with pytest.raises(ToolError) as e:
        safe_eval(expr)
    assert says in str(e.value)
    assert isinstance(e.value, ValueError)


def test_format_number():
    assert format_number(391) == "391"
    assert format_number(-14) == "-14"
    assert format_number(2.5) == "2.5"
    assert format_number(1 / 3) == "0.333333"
    assert format_number(2.0) == "2"
    assert format_number(1e-9) == "0"
    assert format_number(-1e-9) == "0"
    assert format_number(0.1 * 3) == "0.3"
    assert format_number(safe_eval("100000000000000+0.5")) == "100000000000000.5"


def test_last_number():
    assert last_number("The answer is 391.") == 391
    assert last_number("I think -12") == -12
    assert last_number("17-23") == 23  # a minus after a digit is an operator
    assert last_number("1,234 apples") == 1234
    assert last_number("17, 23") == 23
    assert last_number("2.5") == 2.5
    assert last_number("no number") is None


# --- tool-call parsing -------------------------------------------------------------------------------------------


def test_parse_tool_call_formats():
    assert parse_tool_call("391") is None
    assert parse_tool_call("<tool>17*23</tool>") == ToolCall("17*23")
    assert parse_tool_call("Let me compute. <tool> 17 * 23 </tool> ok") == ToolCall("17 * 23")
    assert parse_tool_call("<tool>1+1</tool> then <tool>2+2</tool>") == ToolCall("1+1")  # the first one counts
    assert parse_tool_call("<tool>17*23") == ToolCall("17*23")  # generation stopped on the closing tag
    native = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17*23"}}\n</tool_call>'
    assert parse_tool_call(native) == ToolCall("17*23")
    assert parse_tool_call('<tool_call>{"name":"calculator","arguments":{"expression":"2+2"}}') == ToolCall("2+2")
    as_string = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"3*3\\"}"}</tool_call>'
    assert parse_tool_call(as_string) == ToolCall("3*3")
    first = parse_tool_call('<tool_call>{"name": "calculator", "arguments": {"expression": "5"}}</tool_call><tool>6')
    assert first == ToolCall("5")


@pytest.mark.parametrize(
    "message,says",
    [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>', "malformed"),
        ("<tool_call>not json</tool_call>", "malformed"),
        ("<tool_call>[1, 2]</tool_call>", "JSON object"),
        ('<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>', "unknown tool"),
        ('<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>', "arguments"),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": 5}}</tool_call>', "arguments"),
    ],
)
def test_parse_tool_call_malformed(message, says):
    call = parse_tool_call(message)
    assert call is not None and call.expression is None
    assert says in call.error


# --- calculator episodes -----------------------------------------------------------------------------------------


def test_calculator_demonstrations_win_every_row():
    env = CalculatorEnv()
    for split in ("train", "eval"):
        for row in CalculatorEnv.rows(split, 50, seed=0):
            demo = env.demonstration(row)
            assert demo == [f"<tool>{row.info['expression']}</tool>", row.answer]
            out = play(env, row, demo)
            assert out["done"] and out["correct"] is True
            assert sum(out["turn_rewards"]) == 1.0 and out["turn_rewards"] == [0.0, 1.0]
            m = out["metrics"]
            assert m["tool_calls"] == 1 and m["tool_errors"] == 0 and m["correct_tool_calls"] == 1
            assert m["answered"] == 1 and m["answered_after_tool"] == 1
            tool_msg = out["messages"][2]
            assert tool_msg == {"role": "tool", "content": f"<result>{row.answer}</result>"}


def test_calculator_native_tool_call_and_role():
    env = CalculatorEnv(observation_role="user")
    row = Row(prompt="Tom has 17 boxes with 23 apples each.", answer="391", info={"expression": "17*23"})
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "17 * 23"}}</tool_call>'
    out = play(env, row, [call, "Tom has 391 apples."])
    assert out["correct"] is True and out["turn_rewards"] == [0.0, 1.0]
    assert out["messages"][2] == {"role": "user", "content": "<result>391</result>"}


def test_calculator_wrong_answers_and_tool_errors():
    env = CalculatorEnv()
    row = CalculatorEnv.rows("train", 1, seed=5)[0]
    wrong = str(int(row.answer) + 1)
    for policy in ([wrong], ["I don't know"], [f"<tool>{row.info['expression']}</tool>", wrong]):
        out = play(env, row, policy)
        assert out["done"] and out["correct"] is False and sum(out["turn_rewards"]) == 0.0
        assert out["metrics"]["answered"] == 1 and out["metrics"]["answer_correct"] == 0

    out = play(env, row, ["<tool>__import__('os').system('ls')</tool>", "<tool>1/0</tool>", row.answer])
    assert out["correct"] is True  # tool errors are answered, not raised; the episode goes on
    assert out["metrics"]["tool_calls"] == 2 and out["metrics"]["tool_errors"] == 2
    assert out["metrics"]["correct_tool_calls"] == 0
    assert (
        out["messages"][2]["content"].startswith("<result>error: ") and "not allowed" in out["messages"][2]["content"]
    )
    assert out["messages"][4]["content"] == "<result>error: division by zero</result>"

    out = play(env, row, ["<tool_call>{oops</tool_call>", row.answer])
    assert out["metrics"]["tool_errors"] == 1 and "malformed" in out["messages"][2]["content"]

    # a right answer without any tool call: correct unless the tool is required
    out = play(env, row, [f"The answer is {row.answer}."])
    assert out["correct"] is True and out["metrics"]["answered_after_tool"] == 0
    strict = CalculatorEnv(require_tool=True)
    out = play(strict, row, [row.answer])
    assert out["correct"] is False and sum(out["turn_rewards"]) == 0.0 and out["metrics"]["answer_correct"] == 1
    out = play(strict, row, ["<tool>1/0</tool>", row.answer])  # a failed call does not count
    assert out["correct"] is False
    out = play(strict, row, strict.demonstration(row))
    assert out["correct"] is True and sum(out["turn_rewards"]) == 1.0


def test_calculator_answer_from_other_rows():
    env = CalculatorEnv()
    out = play(env, Row(prompt="What is 23 + 58?", answer="\\boxed{81}"), ["81"])
    assert out["correct"] is True
    out = play(env, Row(prompt="What is 1,000 + 234?", info={"expression": "1000+234"}), ["It is 1,234."])
    assert out["correct"] is True
    with pytest.raises(ValueError, match="no numeric answer"):
        env.reset(Row(prompt="?"), 0)


def test_calculator_kwargs_validated():
    for kwargs, name in [
        ({"observation_role": ""}, "observation_role"),
        ({"observation_role": "assistant"}, "observation_role"),
        ({"observation_role": 3}, "observation_role"),
        ({"require_tool": "yes"}, "require_tool"),
        ({"require_tool": 1}, "require_tool"),
    ]:
        with pytest.raises(ValueError, match=name):
            CalculatorEnv(**kwargs)


def test_calculator_rows_deterministic_and_disjoint():
    eval_rows = CalculatorEnv.rows("eval", 200, seed=0)
    train_rows = CalculatorEnv.rows("train", 2000, seed=0)
    assert eval_rows == CalculatorEnv.rows("eval", 200, seed=0)
    assert train_rows[:100] == CalculatorEnv.rows("train", 100, seed=0)  # a smaller size is a prefix
    assert CalculatorEnv.rows("train", 50, seed=1) != train_rows[:50]
    assert len({r.prompt for r in train_rows}) == len(train_rows)  # distinct within a split
    assert len({r.prompt for r in eval_rows}) == len(eval_rows)
    # held out: no eval problem is a train problem, not even the same computation in other words or order
    assert not {r.prompt for r in eval_rows} & {r.prompt for r in train_rows}
    assert not {r.prompt for r in eval_rows} & {r.prompt for r in CalculatorEnv.rows("train", 2000, seed=7)}

    def canonical(row):
        expr = row.info["expression"]
        op = next(c for c in "+-*" if c in expr)
        a, b = expr.split(op)
        return (op, *sorted((int(a), int(b)))) if op in "+*" else (op, int(a), int(b))

    assert not {canonical(r) for r in eval_rows} & {canonical(r) for r in train_rows}

    ops = {next(c for c in "+-*" if c in r.info["expression"]) for r in train_rows}
    assert ops == {"+", "-", "*"}
    for row in train_rows[:300] + eval_rows:
        assert row.prompt.startswith(INSTRUCTION + "\n")
        assert len(row.prompt.split()) < 25 + len(INSTRUCTION.split())  # short, for a tiny tokenizer
        assert str(safe_eval(row.info["expression"])) == row.answer and int(row.answer) >= 0
        a, b = (int(x) for x in row.info["expression"].replace("+", " ").replace("-", " ").replace("*", " ").split())
        assert str(a) in row.prompt and str(b) in row.prompt


def test_calculator_rows_bad_arguments():
    with pytest.raises(ValueError, match="split"):
        CalculatorEnv.rows("test", 10, seed=0)
    with pytest.raises(ValueError, match="size"):
        CalculatorEnv.rows("train", 0, seed=0)


# --- guess the number --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("high", [16, 2, 3, 100])
def test_guess_number_demonstrations_win_every_row(high):
    env = GuessNumberEnv(high=high)
    rows = GuessNumberEnv.rows("train", 50, seed=0, high=high) + GuessNumberEnv.rows("eval", 50, seed=0, high=high)
    bound = math.ceil(math.log2(high)) + 1
    for row in rows:
        demo = env.demonstration(row)
        assert len(demo) <= bound
        out = play(env, row, demo, max_turns=bound)
        assert out["done"] and out["correct"] is True
        assert out["turn_rewards"][-1] == 1.0 and sum(out["turn_rewards"]) == 1.0
        assert out["metrics"]["guesses"] == len(demo) and "invalid_guesses" not in out["metrics"]
        assert out["messages"][0]["content"] == row.prompt
        for msg in out["messages"][2::2]:
            assert msg["role"] == "user" and msg["content"] in ("Higher.", "Lower.")


def test_guess_number_binary_search():
    assert binary_search_guesses(11, 16) == [8, 12, 10, 11]
    assert binary_search_guesses(8, 16) == [8]
    for high in (2, 7, 16, 33, 1000):
        lengths = [len(binary_search_guesses(s, high)) for s in range(1, high + 1)]
        assert max(lengths) == math.floor(math.log2(high)) + 1 <= math.ceil(math.log2(high)) + 1
    with pytest.raises(ValueError):
        binary_search_guesses(17, 16)


def test_guess_number_feedback_and_invalid_guesses():
    env = GuessNumberEnv()
    row = Row(prompt="Guess 1..16.", answer="11", info={"high": 16})
    out = play(env, row, ["hmm", "0", "17", "I guess -3", "5", "14", "My guess is 11"])
    assert out["correct"] is True and out["turn_rewards"] == [0.0] * 6 + [1.0]
    replies = [m["content"] for m in out["messages"][2::2]]
    assert replies == ["Say a number between 1 and 16."] * 4 + ["Higher.", "Lower."]
    assert out["metrics"] == {"invalid_guesses": 4, "guesses": 3}

    out = play(env, row, ["1", "2", "3"])  # out of turns: not won
    assert out["done"] is False and out["correct"] is False and sum(out["turn_rewards"]) == 0.0

    penalised = GuessNumberEnv(turn_penalty=0.1)
    out = play(penalised, row, ["x", "8", "11"])
    assert out["turn_rewards"] == [-0.1, -0.1, 1.0] and out["correct"] is True


def test_guess_number_range_and_rows():
    rows = GuessNumberEnv.rows("train", 40, seed=3)
    assert rows == GuessNumberEnv.rows("train", 40, seed=3)
    assert rows != GuessNumberEnv.rows("eval", 40, seed=3)
    assert sorted(int(r.answer) for r in rows[:16]) == list(range(1, 17))  # every secret once per round
    assert all(r.info == {"high": 16} and "between 1 and 16" in r.prompt for r in rows)

    wide = GuessNumberEnv(high=64)
    assert "between 1 and 64" in wide.reset(rows[0], 0)  # rows made for another range: the env's own opening
    assert GuessNumberEnv().reset(rows[0], 0) is None
    with pytest.raises(ConfigError, match="outside"):
        GuessNumberEnv(high=4).reset(Row(prompt="?", answer="9"), 0)
    with pytest.raises(ValueError, match="split"):
        GuessNumberEnv.rows("dev", 4, seed=0)
    with pytest.raises(ValueError, match="size"):
        GuessNumberEnv.rows("train", 0, seed=0)
    for kwargs, name in [
        ({"high": 1}, "high"),
        ({"high": "16"}, "high"),
        ({"high": True}, "high"),
        ({"turn_penalty": -0.5}, "turn_penalty"),
        ({"turn_penalty": float("nan")}, "turn_penalty"),
        ({"turn_penalty": "0.1"}, "turn_penalty"),
    ]:
        with pytest.raises(ValueError, match=name):
            GuessNumberEnv(**kwargs)
