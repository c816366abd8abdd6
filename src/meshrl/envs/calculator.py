"""Arithmetic word problems with a calculator tool: the smallest tool-use environment.

The point is to exercise the multi-turn seam end to end on a task a tiny model learns fast: the model may call a
calculator, reads the result back as a tool message, then answers. A good episode is two turns:

    user:       Use <tool>expression</tool> to compute, then answer with the number.
                Tom has 17 boxes with 23 apples each. How many apples does Tom have?
    assistant:  <tool>17*23</tool>
    tool:       <result>391</result>
    assistant:  391                                          -> reward 1.0, correct

Tool calls come in two spellings: the short `<tool>EXPR</tool>` a tiny model learns from demonstrations, and the
native Qwen / Hermes `<tool_call>{"name": "calculator", "arguments": {"expression": "EXPR"}}</tool_call>` that
instruction-tuned models already write. Either way the expression is evaluated by `safe_eval` — an AST walk with a
whitelist, never `eval` — because the text comes from a model being trained and must be treated as hostile.

A message without a tool call is the final answer: its last number is compared with the row's answer. The reward
is the final answer's correctness only (tool calls earn nothing by themselves: the policy learns to call the tool
because it makes the answer right); the metrics count tool calls, tool errors and tool calls that already hold the
answer, so a run shows whether the model learned to use the tool.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import operator
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshrl.errors import ConfigError
from meshrl.rollout.environment import Environment, StepResult
from meshrl.rollout.row import Row

INSTRUCTION = "Use <tool>expression</tool> to compute, then answer with the number."
"""Prepended (own line) to every built-in prompt: the tool's syntax is in the prompt, so a model can use it from
the first step, and the supervised warm-up's demonstrations follow the same instruction."""

MAX_EXPRESSION_CHARS = 200
"""Longer expressions are refused: no arithmetic word problem needs more, and it bounds parsing work."""
MAX_MAGNITUDE = 1e15
"""Every constant and intermediate result must stay within this magnitude: it bounds the work of each operation
(no multi-million-digit integers) and keeps floats exact enough for the answers compared here."""
MAX_EXPONENT = 10
"""`a ** b` needs |b| <= this: with every base bounded by MAX_MAGNITUDE, a power is cheap to compute before its
result is checked."""

EVAL_FRACTION = 10
"""One expression in EVAL_FRACTION (by a stable hash of its canonical form) is held out for 'eval'."""


class ToolError(ValueError):
    """The calculator refused or failed to evaluate an expression; the message says why and is shown to the model
    (as `<result>error: ...</result>`), so it is phrased for the model, not for the operator."""


# --- safe evaluation ---------------------------------------------------------------------------------------------

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_REFUSED_NAMES: dict[type[ast.AST], str] = {
    ast.Name: "names",
    ast.Call: "function calls",
    ast.Attribute: "attributes",
    ast.Subscript: "subscripts",
    ast.Compare: "comparisons",
    ast.BoolOp: "boolean operators",
    ast.Lambda: "lambdas",
    ast.IfExp: "conditional expressions",
    ast.Tuple: "tuples (write numbers without thousands separators)",
    ast.List: "lists",
    ast.Dict: "dicts",
    ast.Set: "sets",
    ast.JoinedStr: "strings",
}
_ALLOWED = "only numbers, + - * / // % **, unary minus and parentheses"


def _check_magnitude(value: Any) -> int | float:
    if isinstance(value, complex):
        raise ToolError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("the result is not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise ToolError(f"a number is too large (the calculator is limited to magnitude {MAX_MAGNITUDE:.0e})")
    return value


def _eval_node(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):  # bool is an int subclass: refused too, like str, bytes, None
            kind = "strings" if isinstance(node.value, str | bytes) else repr(node.value)
            raise ToolError(f"{kind} not allowed: {_ALLOWED}")
        return _check_magnitude(node.value)
    if isinstance(node, ast.BinOp):
        op = _BINARY.get(type(node.op))
        if op is None:
            hint = " (use ** for powers)" if isinstance(node.op, ast.BitXor) else ""
            raise ToolError(f"operator {type(node.op).__name__} not allowed{hint}: {_ALLOWED}")
        left = _eval_node(node.left)
        right = _eval_node(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {format_number(right)} is too large (at most {MAX_EXPONENT} in magnitude)")
        try:
            return _check_magnitude(op(left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("a number is too large") from None
    if isinstance(node, ast.UnaryOp):
        uop = _UNARY.get(type(node.op))
        if uop is None:
            raise ToolError(f"operator {type(node.op).__name__} not allowed: {_ALLOWED}")
        return _check_magnitude(uop(_eval_node(node.operand)))
    what = _REFUSED_NAMES.get(type(node), type(node).__name__)
    raise ToolError(f"{what} not allowed: {_ALLOWED}")


def safe_eval(expr: str) -> int | float:
    """Evaluate an arithmetic expression from untrusted text, or raise `ToolError` saying what was refused.

    Walks `ast.parse(expr, mode="eval")` with a whitelist (int / float constants, + - * / // % **, unary + -,
    parentheses) instead of calling `eval`: model text never reaches the interpreter. Every value is bounded
    (MAX_MAGNITUDE, MAX_EXPONENT, MAX_EXPRESSION_CHARS), so no expression can take long or use much memory.
    An integral float result is returned as an int (`6/3` -> 2), so it prints like the answer it is."""
    if not isinstance(expr, str):
        raise ToolError(f"the expression must be text, got {type(expr).__name__}")
    expr = expr.strip()
    if not expr:
        raise ToolError("empty expression")
    if len(expr) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression too long ({len(expr)} characters, at most {MAX_EXPRESSION_CHARS})")
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ToolError(f"not a valid expression: {expr!r}") from e
    try:
        value = _eval_node(tree.body)
    except RecursionError as e:
        raise ToolError("expression nested too deeply") from e
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def format_number(value: int | float) -> str:
    """A number as the calculator shows it: ints as plain digits, floats rounded to 6 decimal places without
    trailing zeros (`1/3` -> '0.333333', `2.5` -> '2.5'); never scientific notation, which the answer parser (and
    a tiny model) would not read back."""
    if isinstance(value, float):
        if value.is_integer():
            return str(int(value))
        text = f"{value:.6f}".rstrip("0").rstrip(".")
        return "0" if text in ("", "-0") else text
    return str(value)


# --- parsing the model's messages --------------------------------------------------------------------------------

_TOOL_CALL = re.compile(r"<(tool|tool_call)>(.*?)(?:</\1>|\Z)", re.DOTALL)
_NUMBER = re.compile(r"(?<![\d.])-?\d+(?:,\d{3})*(?:\.\d+)?")


@dataclass(frozen=True)
class ToolCall:
    """A tool call found in a message: its expression, or why it could not be read (a malformed call is the
    model's mistake, answered with an error result, never an exception)."""

    expression: str | None
    error: str | None = None


def parse_tool_call(message: str) -> ToolCall | None:
    """The message's first tool call, or None when it holds none (then it is a final answer).

    Accepts `<tool>EXPR</tool>` and `<tool_call>{"name": "calculator", "arguments": {"expression": "EXPR"}}
    </tool_call>` (JSON, whitespace tolerated; `arguments` may also be a JSON-encoded string, as some templates
    write it). A call left open at the end of the message counts as closed there, since generation may stop on
    the closing tag and drop it."""
    match = _TOOL_CALL.search(message)
    if match is None:
        return None
    kind, body = match.group(1), match.group(2).strip()
    if kind == "tool":
        return ToolCall(body)
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return ToolCall(None, 'malformed tool call: expected {"name": "calculator", "arguments": {"expression": ...}}')
    if not isinstance(call, dict):
        return ToolCall(None, "malformed tool call: expected a JSON object")
    name = call.get("name")
    if name != "calculator":
        return ToolCall(None, f"unknown tool {name!r}: the only tool is 'calculator'")
    args = call.get("arguments", call.get("parameters"))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            args = None
    if not isinstance(args, dict) or not isinstance(args.get("expression"), str):
        return ToolCall(None, 'malformed tool call: "arguments" must be {"expression": "<arithmetic>"}')
    return ToolCall(args["expression"])


def last_number(text: str) -> float | None:
    """The last number in `text` (optional minus sign, thousands commas tolerated: '1,234' is 1234), or None.
    A minus right after a digit is an operator, not a sign ('17-23' ends with 23)."""
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    return float(matches[-1].replace(",", ""))


def _same_number(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(b))


# --- the environment ---------------------------------------------------------------------------------------------

_NAMES = ("Tom", "Ann", "Sam", "Mia", "Ben", "Zoe", "Max", "Lily")
_ITEMS = ("apples", "cards", "coins", "marbles", "stickers", "shells")
# (operation, template): operands {a} and {b} appear in the expression's order, so the demonstration is `a op b`.
_TEMPLATES: dict[str, tuple[str, ...]] = {
    "+": (
        "{n} has {a} {i} and gets {b} more. How many {i} does {n} have now?",
        "A box holds {a} red and {b} blue {i}. How many {i} are in the box?",
        "{n} read {a} pages on Monday and {b} on Tuesday. How many pages in total?",
    ),
    "-": (
        "{n} has {a} {i} and gives away {b}. How many {i} are left?",
        "A shop had {a} books and sold {b}. How many books remain?",
        "{n} needs {a} points and has {b}. How many more points are needed?",
    ),
    "*": (
        "{n} has {a} boxes with {b} {i} each. How many {i} does {n} have?",
        "A garden has {a} rows of {b} plants. How many plants are there?",
        "{n} buys {a} packs of {b} pens. How many pens is that?",
    ),
}


def _held_out(op: str, a: int, b: int) -> bool:
    """Whether this computation belongs to the 'eval' split: decided by a stable hash of its canonical form (a+b
    and b+a are the same computation), so the splits are disjoint for any sizes and seeds and no held-out
    problem is a training problem in other words."""
    x, y = (min(a, b), max(a, b)) if op in "+*" else (a, b)
    digest = hashlib.sha256(f"{x}{op}{y}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % EVAL_FRACTION == 0


def _problem(rng: random.Random) -> tuple[str, str, int, int, int]:
    """One word problem: (text, operation, a, b, value), its expression f"{a}{op}{b}". Small operands so a tiny
    model can learn the mapping; a subtraction never goes below zero."""
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(2, 19), rng.randint(2, 19)
    else:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if op == "-" and a < b:
            a, b = b, a
    template = rng.choice(_TEMPLATES[op])
    text = template.format(n=rng.choice(_NAMES), i=rng.choice(_ITEMS), a=a, b=b)
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return text, op, a, b, value


class CalculatorEnv(Environment):
    """Arithmetic word problems; the model may call a calculator before answering (see the module docstring).

    kwargs (a JSON object on the command line):
      observation_role: the role of the tool-result message ("tool": what Qwen / Hermes chat templates render as
        a tool response; "user" for a template without a tool role).
      require_tool: when true, the episode is correct (reward 1.0) only if the right final answer comes after at
        least one tool call that returned a result; a right answer without one gets reward 0.0 and
        correct=False (the metric `answer_correct` still shows the number was right). Use it to teach the tool
        itself rather than the arithmetic."""

    def __init__(self, observation_role: str = "tool", require_tool: bool = False, demo_tool_rate: float = 1.0) -> None:
        if not isinstance(observation_role, str) or not observation_role.strip():
            raise ConfigError(
                f"CalculatorEnv kwarg observation_role={observation_role!r}: give a chat role, e.g. 'tool' or 'user'"
            )
        if observation_role == "assistant":
            raise ConfigError(
                "CalculatorEnv kwarg observation_role='assistant': tool results must not look like the model's own "
                "messages; give 'tool' or 'user'"
            )
        if not isinstance(require_tool, bool):
            raise ConfigError(f"CalculatorEnv kwarg require_tool={require_tool!r}: give true or false")
        if not isinstance(demo_tool_rate, int | float) or not 0.0 <= demo_tool_rate <= 1.0:
            raise ConfigError(f"CalculatorEnv kwarg demo_tool_rate={demo_tool_rate!r}: give a fraction in [0, 1]")
        # The share of demonstrations that call the tool; the others answer at once, as SFT data mixing both
        # styles does. RL then has a choice to learn: the tool makes answers right more often than mental arithmetic.
        self.demo_tool_rate = float(demo_tool_rate)
        self.observation_role = observation_role
        self.require_tool = require_tool
        self.answer: float | None = None
        self.tool_calls = 0
        self.tool_results = 0  # tool calls that returned a value (not an error)

    def reset(self, row: Row, seed: int) -> None:
        """The row's prompt opens the episode. The gold is the last number of `row.answer` (so rows from other
        tasks, e.g. '\\boxed{81}', work too), or the value of `info["expression"]` when the row has no answer."""
        gold = last_number(row.answer) if row.answer is not None else None
        if gold is None and isinstance(row.info.get("expression"), str):
            gold = float(safe_eval(row.info["expression"]))
        if gold is None:
            raise ValueError(
                f"CalculatorEnv: row {row.prompt!r} has no numeric answer and no info['expression']; give rows "
                "with answer='<number>'"
            )
        self.answer = gold
        self.tool_calls = 0
        self.tool_results = 0
        return None

    def step(self, message: str) -> StepResult:
        if self.answer is None:
            raise RuntimeError("CalculatorEnv.step called before reset")
        call = parse_tool_call(message)
        if call is not None:
            return self._tool_step(call)
        number = last_number(message)
        right = number is not None and _same_number(number, self.answer)
        correct = right and (self.tool_results > 0 or not self.require_tool)
        return StepResult(
            reward=1.0 if correct else 0.0,
            done=True,
            correct=correct,
            metrics={
                "answered": 1,
                "answered_after_tool": int(self.tool_calls > 0),
                "answer_correct": int(right),
            },
        )

    def _tool_step(self, call: ToolCall) -> StepResult:
        self.tool_calls += 1
        value: int | float | None = None
        if call.error is not None:
            content = f"<result>error: {call.error}</result>"
        else:
            try:
                value = safe_eval(call.expression or "")
                content = f"<result>{format_number(value)}</result>"
            except ToolError as e:
                content = f"<result>error: {e}</result>"
        if value is not None:
            self.tool_results += 1
        assert self.answer is not None
        return StepResult(
            observation=[{"role": self.observation_role, "content": content}],
            reward=0.0,
            done=False,
            metrics={
                "tool_calls": 1,
                "tool_errors": int(value is None),
                "correct_tool_calls": int(value is not None and _same_number(float(value), self.answer)),
            },
        )

    @classmethod
    def rows(cls, split: str, size: int, seed: int) -> list[Row]:
        """`size` distinct word problems, the same for the same (split, size, seed), and a prefix of a larger
        size's. 'eval' and 'train' draw from disjoint computations (see `_held_out`), so no held-out problem is a
        training problem, whatever the seeds and sizes."""
        if split not in ("train", "eval"):
            raise ConfigError(f"CalculatorEnv.rows: split={split!r}; give 'train' or 'eval'")
        if not isinstance(size, int) or size < 1:
            raise ConfigError(f"CalculatorEnv.rows: size={size!r}; give at least 1")
        rng = random.Random(f"calculator-{split}-{seed}")
        want_eval = split == "eval"
        seen: set[str] = set()
        out: list[Row] = []
        for _ in range(100 * size):
            if len(out) == size:
                break
            text, op, a, b, value = _problem(rng)
            if _held_out(op, a, b) != want_eval or text in seen:
                continue
            seen.add(text)
            out.append(Row(prompt=f"{INSTRUCTION}\n{text}", answer=str(value), info={"expression": f"{a}{op}{b}"}))
        if len(out) < size:
            raise ConfigError(
                f"CalculatorEnv.rows: found only {len(out)} distinct {split} problems of the {size} asked for; "
                "ask for fewer"
            )
        return out

    def demonstration(self, row: Row) -> list[str] | None:
        """Call the tool on the row's expression, then answer: the two-turn episode the warm-up teaches; or, for a
        (1 - demo_tool_rate) share of the rows (chosen by a stable hash of the prompt), the answer at once."""
        expr = row.info.get("expression")
        if not isinstance(expr, str):
            return None
        answer = row.answer if row.answer is not None else format_number(safe_eval(expr))
        draw = int.from_bytes(hashlib.sha256(str(row.prompt).encode()).digest()[:8], "big") / 2**64
        if draw >= self.demo_tool_rate:
            return [answer]
        return [f"<tool>{expr}</tool>", answer]


__all__ = [
    "INSTRUCTION",
    "CalculatorEnv",
    "ToolCall",
    "ToolError",
    "format_number",
    "last_number",
    "parse_tool_call",
    "safe_eval",
]
