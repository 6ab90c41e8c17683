"""Just enough of bash to read a Megatron-LM launch script offline.

Megatron's example scripts set variables and arrays, branch on simple string tests and end in
`torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py ${MODEL_ARGS[@]} ...`. `launch_command` runs
that subset: scalar and array assignments (`=`, `+=`, `export`), `$X`, `${X}`, `${X:-default}`,
`${A[@]}`, `$((arithmetic))`, and `if/elif/else/fi` on `[[ a == b ]]`, `!=`, `-z`, `-n` joined
by `||` / `&&`. Anything else (command substitution, file tests, loops) is not evaluated; the
notes say so. Positional parameters ($1 ...) are unset, so `${1:-default}` takes the default.
"""
from __future__ import annotations

import ast
import operator
import re
import shlex
from dataclasses import dataclass, field

from ms_llm.convert.common import ConversionError

_ASSIGN = re.compile(r"^(?:export\s+)?([A-Za-z_]\w*)(\+?)=(.*)$", re.S)
_VAR = re.compile(r"\$\(\((?P<arith>.*?)\)\)|\$\{(?P<arr>\w+)\[@\]\}|\$\{(?P<name>\w+)(?::-(?P<default>[^}]*))?\}"
                  r"|\$(?P<bare>[A-Za-z_]\w*|\d)")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Div: operator.floordiv, ast.Mod: operator.mod}


@dataclass
class Launch:
    launcher: list[str]                  # e.g. ['torchrun', '--nproc_per_node', '8', ...]
    program: str                         # e.g. 'pretrain_gpt.py'
    args: list[str]                      # everything after the program
    notes: list[str] = field(default_factory=list)


def _arith(expr: str) -> str:
    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(expr)
    return str(ev(ast.parse(expr.replace("/", "//"), mode="eval")))


class _Shell:
    def __init__(self, source: str):
        self.source = source
        self.scalars: dict[str, str] = {}
        self.arrays: dict[str, list[str]] = {}
        self.notes: list[str] = []

    def expand(self, text: str, line: int) -> str:
        def sub(m: re.Match) -> str:
            if m.group("arith") is not None:
                inner = self.expand(re.sub(r"(?<![$\w])([A-Za-z_]\w*)", r"$\1", m.group("arith")), line)
                try:
                    return _arith(inner)
                except (ValueError, SyntaxError, ZeroDivisionError):
                    self.notes.append(f"{self.source}:{line}: $(({m.group('arith')})) not evaluated")
                    return ""
            if m.group("arr") is not None:
                return " ".join(self.arrays.get(m.group("arr"), []))   # unquoted: bash word-splits
            name = m.group("name") or m.group("bare")
            value = self.scalars.get(name, "")
            if not value and m.group("default") is not None:
                return self.expand(m.group("default"), line)
            return value
        return _VAR.sub(sub, text)

    def words(self, text: str, line: int) -> list[str]:
        try:
            return shlex.split(self.expand(text, line), comments=True)
        except ValueError as exc:
            raise ConversionError(f"{self.source}:{line}: cannot split shell words ({exc})") from None

    def condition(self, text: str, line: int) -> bool | None:
        """Value of `[[ ... ]] || [[ ... ]]`; None when the test is not a plain string test."""
        words = self.words(text, line)
        result: bool | None = None
        joiner = None
        i = 0
        while i < len(words):
            if words[i] in ("||", "&&"):
                joiner = words[i]
                i += 1
                continue
            if words[i] not in ("[[", "["):
                return None
            close = "]]" if words[i] == "[[" else "]"
            try:
                end = words.index(close, i)
            except ValueError:
                return None
            test = words[i + 1:end]
            negate = bool(test) and test[0] == "!"
            test = test[1:] if negate else test
            if len(test) == 3 and test[1] in ("==", "="):
                value = test[0] == test[2]
            elif len(test) == 3 and test[1] == "!=":
                value = test[0] != test[2]
            elif len(test) == 2 and test[0] in ("-z", "-n"):
                value = (test[1] == "") == (test[0] == "-z")
            elif len(test) == 1 and test[0] in ("-z", "-n"):
                value = test[0] == "-z"          # the operand expanded to nothing
            else:
                return None
            value = value != negate
            result = value if result is None else (result or value) if joiner == "||" else (result and value)
            i = end + 1
        return result

    def assign(self, name: str, append: bool, rhs: str, line: int) -> None:
        if rhs.startswith("("):
            body = "\n".join(_strip_comment(part) for part in rhs.splitlines())
            body = body[1:body.rindex(")")] if ")" in body else body[1:]
            values = self.words(body, line)
            self.arrays[name] = (self.arrays.get(name, []) if append else []) + values
            return
        words = self.words(rhs, line)
        value = " ".join(words)
        self.scalars[name] = (self.scalars.get(name, "") if append else "") + value


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Join backslash continuations and multi-line array assignments; keep the first line number."""
    out: list[tuple[int, str]] = []
    pending, start, in_array = "", 0, False
    for number, raw in enumerate(text.splitlines(), 1):
        if not pending:
            start = number
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        pending += raw
        if not in_array:
            m = _ASSIGN.match(pending.strip())
            in_array = bool(m) and m.group(3).lstrip().startswith("(")
        if in_array:
            if _strip_comment(raw).rstrip().endswith(")"):
                in_array = False
            else:
                pending += "\n"
                continue
        out.append((start, pending))
        pending = ""
    if pending:
        out.append((start, pending))
    return out


def _strip_comment(line: str) -> str:
    """The line up to an unquoted `#` that starts a word."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def launch_command(text: str, source: str) -> Launch:
    """The last command that runs a Python program with `--flag` arguments, fully expanded."""
    sh = _Shell(source)
    stack: list[tuple[bool, bool]] = []          # (this branch runs, some branch already ran)
    launch: Launch | None = None
    for number, line in _logical_lines(text):
        code = line.strip()
        if not code or code.startswith("#"):
            continue
        head = code.split(None, 1)[0].rstrip(";")
        active = all(run for run, _ in stack)
        if head in ("if", "elif"):
            cond_text = re.sub(r";?\s*then\s*$", "", code.split(None, 1)[1] if " " in code else "")
            value = sh.condition(cond_text, number) if (active or head == "elif") else False
            if value is None:
                sh.notes.append(f"{source}:{number}: condition `{cond_text.strip()}` is not a string test; "
                                "its branch is skipped")
                value = False
            if head == "if":
                stack.append((value and active, value))
            elif stack:
                _, taken = stack[-1]
                outer = all(run for run, _ in stack[:-1])
                stack[-1] = (outer and not taken and value, taken or value)
            continue
        if head == "else":
            if stack:
                _, taken = stack[-1]
                outer = all(run for run, _ in stack[:-1])
                stack[-1] = (outer and not taken, True)
            continue
        if head == "fi":
            if stack:
                stack.pop()
            continue
        if head == "then" or not active:
            continue
        m = _ASSIGN.match(code)
        if m:
            sh.assign(m.group(1), m.group(2) == "+", m.group(3).strip(), number)
            continue
        try:
            words = sh.words(code, number)
        except ConversionError as exc:
            sh.notes.append(f"{exc}; line skipped")
            continue
        script = next((i for i, w in enumerate(words) if w.endswith(".py")), None)
        if script is None:                  # `torchrun ... -m torchtitan.train --flags`: the last -m module
            script = next((i for i in range(len(words) - 1, 0, -1) if words[i - 1] == "-m"), None)
        if script is not None and any(w.startswith("--") for w in words[script + 1:]):
            launcher = words[:script - 1] if words[script - 1] == "-m" else words[:script]
            launch = Launch(launcher, words[script], words[script + 1:])
    if launch is None:
        raise ConversionError(f"{source}: no command that runs a .py program or -m module with --arguments (e.g. "
                              "`torchrun ... pretrain_gpt.py --tensor-model-parallel-size 8 ...`); "
                              "pass the script that launches Megatron-LM, or a file holding just its arguments")
    launch.notes = sh.notes
    return launch
