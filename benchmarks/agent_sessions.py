"""Scripted coding-agent sessions (Anthropic Messages shape) for ``benchmarks/agent_replay.py``.

Deterministic from a seed, no model in the loop: the assistant turns are the script's, as in
recorded agent traffic. Every session shares one system prompt and one set of tool
definitions (``shared_system_prompt`` / ``tool_definitions``: a coding agent's read_file,
write_file, edit_file, bash, grep, ...). A session's requests (``session_requests``) are:

1. a user request (a coding task);
2. a tool loop: an assistant message (a ``thinking`` block, a short text, one or two
   ``tool_use`` blocks) answered by a user message of ``tool_result`` blocks (file contents,
   command output, grep hits: ``tool_output_chars`` each, times ``size_scale``);
3. after ``loop_len`` loop steps, a closing assistant answer (thinking + text) and a new user
   message, then another tool loop; and so on until ``turns`` requests.

Each request carries the whole conversation so far. Thinking blocks stay on the assistant
messages of the current tool loop and are dropped from earlier ones once a new user message
arrives (as clients do; the gateway drops all of them from the prompt anyway).
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]

WORDS = ("config", "parser", "cache", "session", "token", "request", "engine", "buffer", "index", "page",
         "state", "client", "server", "router", "handler", "schema", "record", "stream", "worker", "queue",
         "limit", "batch", "offset", "digest", "entry", "ledger", "chunk", "frame", "codec", "metric")
VERBS = ("load", "parse", "build", "read", "write", "flush", "check", "merge", "split", "encode", "decode",
         "resolve", "render", "submit", "collect", "evict", "restore", "update", "validate", "compute")
DONE = ("loaded", "parsed", "built", "read", "written", "flushed", "checked", "merged", "split", "encoded",
        "decoded", "resolved", "rendered", "submitted", "collected", "evicted", "restored", "updated")
DIRS = ("src/core", "src/net", "src/store", "src/cli", "tests/unit", "tests/integration", "lib/util")

SYSTEM_SENTENCES = (
    "You are an interactive command-line agent that helps users with software engineering tasks.",
    "Use the instructions below and the tools available to you to assist the user.",
    "Be concise, direct and to the point; answer in fewer than four lines unless asked for detail.",
    "Before editing a file, read it; never guess at its contents or at the libraries a project uses.",
    "Follow the conventions of the existing code: naming, formatting, typing and the test layout.",
    "When you run a non-trivial bash command, explain what it does and why you are running it.",
    "Never commit changes unless the user explicitly asks you to; never push to a remote.",
    "Prefer editing existing files to creating new ones; never create documentation files unprompted.",
    "Use the todo list tool to plan multi-step work and mark items done as soon as they are done.",
    "When a test fails, read the failure carefully and fix the cause, not the symptom.",
    "Search the codebase with grep and glob before assuming where something is defined.",
    "Keep secrets out of logs and commits; do not print environment variables or credentials.",
    "If a command may take long, run it with a timeout and report what it printed.",
    "Refer to code locations as path:line so the user can navigate to them.",
    "Batch independent tool calls in one message so they run in parallel.",
    "After making a change, run the relevant tests and the linter, and fix what they report.",
)

# name -> (description, {param: (json type, description)}, required params)
TOOL_SPECS: tuple[tuple[str, str, dict[str, tuple[str, str]], tuple[str, ...]], ...] = (
    ("read_file", "Reads a file from the local filesystem. The path must be absolute. By default it reads up "
     "to 2000 lines from the start; give offset and limit for long files. Lines are numbered from 1.",
     {"path": ("string", "absolute path of the file to read"), "offset": ("integer", "first line to read"),
      "limit": ("integer", "number of lines to read")}, ("path",)),
    ("write_file", "Writes a file to the local filesystem, overwriting any existing file. Read an existing "
     "file first. Prefer edit_file for changes to existing files.",
     {"path": ("string", "absolute path of the file"), "content": ("string", "the full new content")},
     ("path", "content")),
    ("edit_file", "Performs an exact string replacement in a file. old_string must be unique in the file "
     "unless replace_all is set; keep the indentation exactly as it appears after the line number prefix.",
     {"path": ("string", "absolute path of the file"), "old_string": ("string", "text to replace"),
      "new_string": ("string", "replacement text"), "replace_all": ("boolean", "replace every occurrence")},
     ("path", "old_string", "new_string")),
    ("bash", "Executes a bash command in a persistent shell session with an optional timeout. Quote paths "
     "that contain spaces. Avoid interactive commands. Output beyond 30000 characters is truncated.",
     {"command": ("string", "the command to run"), "timeout": ("integer", "milliseconds, at most 600000"),
      "description": ("string", "what the command does, in five to ten words")}, ("command",)),
    ("grep", "Searches file contents with a regular expression (ripgrep syntax). Filter files with glob or "
     "type. Output modes: content shows matching lines, files_with_matches shows paths, count shows counts.",
     {"pattern": ("string", "regular expression"), "path": ("string", "file or directory to search"),
      "glob": ("string", "glob filter, e.g. *.py"), "output_mode": ("string", "content | files_with_matches | count"),
      "context": ("integer", "lines of context around each match")}, ("pattern",)),
    ("glob", "Finds files by name pattern such as **/*.py, sorted by modification time.",
     {"pattern": ("string", "glob pattern"), "path": ("string", "directory to search in")}, ("pattern",)),
    ("list_dir", "Lists files and directories in a path, with sizes; ignores paths matched by ignore globs.",
     {"path": ("string", "absolute directory path"), "ignore": ("array", "glob patterns to ignore")}, ("path",)),
    ("todo_write", "Creates and manages a structured task list for the current session: pending, "
     "in_progress or completed items; exactly one item is in progress at a time.",
     {"todos": ("array", "the updated todo list")}, ("todos",)),
    ("run_tests", "Runs the project's test suite or a subset of it and returns the summary and failures.",
     {"target": ("string", "test file, directory or node id"), "extra_args": ("string", "extra runner flags")},
     ("target",)),
    ("web_fetch", "Fetches a URL and returns its content converted to markdown, processed by a prompt.",
     {"url": ("string", "the URL to fetch"), "prompt": ("string", "what to extract from the page")},
     ("url", "prompt")),
    ("web_search", "Searches the web and returns result titles, URLs and snippets.",
     {"query": ("string", "the search query"), "allowed_domains": ("array", "only these domains")}, ("query",)),
    ("notebook_edit", "Replaces, inserts or deletes a cell of a Jupyter notebook.",
     {"notebook_path": ("string", "absolute path"), "cell_id": ("string", "the cell's id"),
      "new_source": ("string", "new cell source"), "edit_mode": ("string", "replace | insert | delete")},
     ("notebook_path", "new_source")),
    ("task", "Launches a subagent to handle a complex, multi-step task autonomously and returns its report.",
     {"description": ("string", "a short description of the task"), "prompt": ("string", "the task for the agent"),
      "subagent_type": ("string", "which kind of agent")}, ("description", "prompt")),
    ("bash_output", "Retrieves output from a running or completed background bash shell.",
     {"shell_id": ("string", "the background shell's id"), "filter": ("string", "regex filter for lines")},
     ("shell_id",)),
    ("kill_shell", "Kills a running background bash shell by its id.",
     {"shell_id": ("string", "the shell to kill")}, ("shell_id",)),
    ("git_diff", "Shows the working tree's diff against HEAD or a given revision, optionally for one path.",
     {"revision": ("string", "revision to diff against"), "path": ("string", "limit to this path")}, ()),
    ("git_log", "Shows recent commits with their messages, optionally for one path.",
     {"path": ("string", "limit to this path"), "max_count": ("integer", "number of commits")}, ()),
    ("lint", "Runs the project's linter and type checker on the given paths and returns the findings.",
     {"paths": ("array", "files or directories")}, ("paths",)),
    ("format", "Formats the given files with the project's formatter.",
     {"paths": ("array", "files to format")}, ("paths",)),
    ("symbol_search", "Finds definitions and references of a symbol with the language server.",
     {"symbol": ("string", "symbol name"), "kind": ("string", "definition | references")}, ("symbol",)),
    ("ask_user", "Asks the user a multiple-choice question when a decision is needed to continue.",
     {"question": ("string", "the question"), "options": ("array", "two to four answers")}, ("question", "options")),
    ("exit_plan_mode", "Presents the plan to the user for approval before starting to code.",
     {"plan": ("string", "the plan in markdown")}, ("plan",)),
    ("read_many", "Reads several files at once and returns their contents concatenated with headers.",
     {"paths": ("array", "absolute paths")}, ("paths",)),
    ("diagnostics", "Returns the language server's current errors and warnings for a file.",
     {"path": ("string", "absolute path")}, ("path",)),
)
MAX_TOOLS = len(TOOL_SPECS)

TASKS = (
    "The test {test} fails after the last refactor of {mod}. Find out why and fix it.",
    "Add a --{flag} option to the {cmd} command and cover it with a test.",
    "{mod} is slow when the {noun} list is large; profile it and make it faster.",
    "Rename {func} to {func2} everywhere and keep the public API working with a deprecation alias.",
    "Write unit tests for {mod}; the {noun} edge cases are not covered at all.",
    "There is a race between {func} and the {noun} worker; make the shutdown path safe.",
)
FOLLOW_UPS = (
    "Thanks. Now also handle the case where the {noun} is empty.",
    "That broke {test}. Please look again.",
    "Good. Can you also update the docs for {func}?",
    "Please run the whole test suite and fix anything that fails.",
    "Make the error message for a bad {noun} more helpful.",
)


@dataclass(frozen=True)
class ScriptConfig:
    seed: int = 0
    turns: int = 8  # requests per session
    tools: int = 16  # tool definitions (1 .. MAX_TOOLS)
    system_chars: int = 12000  # shared system prompt length
    tool_output_chars: tuple[int, int] = (300, 3000)  # one tool result's size (before size_scale)
    loop_len: tuple[int, int] = (2, 5)  # tool-loop steps before the assistant answers and the user speaks
    parallel_calls: float = 0.2  # chance that an assistant step makes two tool calls
    size_scale: float = 1.0  # multiplies tool result sizes (agent_replay's --context-tokens sets it)

    def __post_init__(self) -> None:
        if not 1 <= self.tools <= MAX_TOOLS:
            raise ValueError(f"tools={self.tools}: must be 1..{MAX_TOOLS}")
        if self.turns < 1 or self.loop_len[0] < 1 or self.loop_len[0] > self.loop_len[1]:
            raise ValueError(f"turns={self.turns}, loop_len={self.loop_len}: need turns >= 1 and 1 <= min <= max")
        if not 0 < self.tool_output_chars[0] <= self.tool_output_chars[1]:
            raise ValueError(f"tool_output_chars={self.tool_output_chars}: need 0 < min <= max")


def shared_system_prompt(cfg: ScriptConfig) -> str:
    """The system prompt every session sends: instruction sentences (order from the seed) in
    paragraphs until ``system_chars``, then a fixed environment block."""
    rng = random.Random(f"system:{cfg.seed}")
    env = "\n\n<env>\nWorking directory: /home/dev/project\nPlatform: linux\nShell: bash\n</env>"
    parts: list[str] = []
    size = 0
    while size < max(0, cfg.system_chars - len(env)):
        sentences = list(SYSTEM_SENTENCES)
        rng.shuffle(sentences)
        para = " ".join(sentences[: rng.randint(3, 6)])
        parts.append(para)
        size += len(para) + 2
    return ("\n\n".join(parts))[: max(0, cfg.system_chars - len(env))] + env


def tool_definitions(cfg: ScriptConfig) -> list[dict[str, Any]]:
    """The first ``cfg.tools`` tools, as Anthropic tool definitions."""
    out = []
    for name, desc, params, required in TOOL_SPECS[: cfg.tools]:
        props: dict[str, Any] = {}
        for p, (kind, pdesc) in params.items():
            props[p] = {"type": kind, "description": pdesc}
            if kind == "array":
                props[p]["items"] = {"type": "string"} if p != "todos" else {"type": "object"}
        out.append({"name": name, "description": desc,
                    "input_schema": {"type": "object", "properties": props, "required": list(required)}})
    return out


class _Text:
    """Deterministic code-ish text from one ``random.Random``."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def ident(self) -> str:
        return f"{self.rng.choice(VERBS)}_{self.rng.choice(WORDS)}"

    def path(self) -> str:
        return f"/home/dev/project/{self.rng.choice(DIRS)}/{self.rng.choice(WORDS)}_{self.rng.choice(WORDS)}.py"

    def code_line(self, indent: int) -> str:
        r = self.rng
        pad = "    " * indent
        kind = r.randrange(6)
        if kind == 0:
            return f"{pad}def {self.ident()}(self, {r.choice(WORDS)}: {r.choice(('int', 'str', 'bytes'))}) -> None:"
        if kind == 1:
            return f"{pad}{r.choice(WORDS)} = self.{self.ident()}({r.choice(WORDS)}, {r.randint(0, 4096)})"
        if kind == 2:
            a, b, c = r.choice(WORDS), r.choice(WORDS), r.choice(WORDS)
            return f"{pad}if {a}.{b} is None or len({c}) > {r.randint(1, 64)}:"
        if kind == 3:
            return f"{pad}return {self.ident()}({r.choice(WORDS)}, key={r.choice(WORDS)}_{r.choice(WORDS)})"
        if kind == 4:
            return f"{pad}# {r.choice(VERBS)} the {r.choice(WORDS)} before the {r.choice(WORDS)} is {r.choice(DONE)}"
        return f"{pad}raise ValueError(f\"bad {r.choice(WORDS)}: {{{r.choice(WORDS)}!r}}\")"

    def lines_to(self, chars: int, line: Any) -> str:
        out: list[str] = []
        size = 0
        i = 1
        while size < chars:
            text = line(i)
            out.append(text)
            size += len(text) + 1
            i += 1
        return "\n".join(out)[:chars]

    def file_listing(self, chars: int) -> str:
        start = self.rng.randint(1, 400)
        return self.lines_to(chars, lambda i: f"{start + i:>6}\t{self.code_line(self.rng.randint(0, 3))}")

    def grep_output(self, chars: int) -> str:
        return self.lines_to(chars, lambda i: f"{self.path()}:{self.rng.randint(1, 900)}:{self.code_line(1)}")

    def test_output(self, chars: int) -> str:
        r = self.rng
        head = f"============ test session starts ============\ncollected {r.randint(20, 400)} items\n"
        body = self.lines_to(max(0, chars - len(head) - 60), lambda i: (
            f"tests/unit/test_{r.choice(WORDS)}.py::test_{self.ident()} {r.choice(('PASSED', 'PASSED', 'FAILED'))}"
            f" [{min(99, i * 3):>3}%]"))
        tail = f"\n==== {r.randint(1, 5)} failed, {r.randint(20, 300)} passed in {r.random() * 9:.2f}s ===="
        return head + body + tail

    def sentence(self) -> str:
        r = self.rng
        return (f"The {r.choice(WORDS)} is {r.choice(DONE)} in {self.ident()} before the "
                f"{r.choice(WORDS)} {r.choice(('arrives', 'is flushed', 'is checked', 'expires'))}.")

    def prose(self, chars: int) -> str:
        out = ""
        while len(out) < chars:
            out += self.sentence() + " "
        return out[:chars].rstrip()


def _fill(template: str, t: _Text) -> str:
    r = t.rng
    return template.format(test=f"tests/unit/test_{r.choice(WORDS)}.py::test_{t.ident()}", mod=t.path(),
                           flag=f"{r.choice(WORDS)}-{r.choice(WORDS)}", cmd=r.choice(WORDS), noun=r.choice(WORDS),
                           func=t.ident(), func2=t.ident())


def _tool_call(t: _Text, names: list[str], call_id: str) -> tuple[Message, str]:
    """One ``tool_use`` block and the kind of output it gets."""
    r = t.rng
    name = r.choice([n for n in ("read_file", "bash", "grep", "edit_file", "run_tests", "glob") if n in names]
                    or names)
    inputs: dict[str, Any] = {
        "read_file": {"path": t.path()},
        "bash": {"command": f"python -m pytest -q {t.path()} -x", "description": "run the failing tests"},
        "grep": {"pattern": t.ident(), "path": "/home/dev/project/src", "output_mode": "content"},
        "edit_file": {"path": t.path(), "old_string": t.code_line(1), "new_string": t.code_line(1)},
        "run_tests": {"target": f"tests/unit/test_{r.choice(WORDS)}.py"},
        "glob": {"pattern": f"**/*{r.choice(WORDS)}*.py"},
    }.get(name, {})
    return {"type": "tool_use", "id": call_id, "name": name, "input": inputs}, name


def _tool_output(t: _Text, name: str, chars: int) -> str:
    if name in ("bash", "run_tests"):
        return t.test_output(chars)
    if name in ("grep", "glob"):
        return t.grep_output(chars)
    if name == "edit_file":
        return f"The file {t.path()} has been updated. Here is a snippet of the edited file:\n" + t.file_listing(chars)
    return t.file_listing(chars)


def _drop_thinking(messages: list[Message]) -> None:
    for m in messages:
        if m["role"] == "assistant" and isinstance(m["content"], list):
            m["content"] = [b for b in m["content"] if b.get("type") != "thinking"]


def session_requests(cfg: ScriptConfig, index: int) -> list[list[Message]]:
    """The ``messages`` of each of session ``index``'s ``cfg.turns`` requests."""
    t = _Text(random.Random(f"session:{cfg.seed}:{index}"))
    r = t.rng
    names = [spec[0] for spec in TOOL_SPECS[: cfg.tools]]
    lo, hi = cfg.tool_output_chars
    history: list[Message] = [{"role": "user", "content": [{"type": "text", "text": _fill(r.choice(TASKS), t)}]}]
    requests = [copy.deepcopy(history)]
    loop_left = r.randint(*cfg.loop_len)
    for k in range(2, cfg.turns + 1):
        thinking = {"type": "thinking", "thinking": t.prose(r.randint(80, 400)), "signature": f"sig-{index}-{k}"}
        if loop_left == 0:  # the assistant answers; the user asks for more
            answer = {"type": "text", "text": t.prose(r.randint(150, 500))}
            history.append({"role": "assistant", "content": [thinking, answer]})
            _drop_thinking(history)
            history.append({"role": "user", "content": [{"type": "text", "text": _fill(r.choice(FOLLOW_UPS), t)}]})
            loop_left = r.randint(*cfg.loop_len)
        else:
            calls = [_tool_call(t, names, f"toolu_{index:03d}_{k:03d}_{c}")
                     for c in range(2 if r.random() < cfg.parallel_calls else 1)]
            text = {"type": "text", "text": f"Let me {r.choice(VERBS)} the {r.choice(WORDS)} first."}
            history.append({"role": "assistant", "content": [thinking, text, *(c for c, _ in calls)]})
            results = []
            for c, name in calls:
                size = max(1, int(r.randint(lo, hi) * cfg.size_scale))
                # its own generator: the session's structure does not depend on the sizes
                out = _tool_output(_Text(random.Random(f"{c['id']}:{cfg.seed}")), name, size)
                results.append({"type": "tool_result", "tool_use_id": c["id"], "content": out})
            history.append({"role": "user", "content": results})
            loop_left -= 1
        requests.append(copy.deepcopy(history))
    return requests
