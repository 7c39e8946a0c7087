"""A scripted ``deepwell.engine.v1.Engine`` test double: a real gRPC server on port 0.

It serves a real (tiny, trained on the spot) byte-level BPE ``tokenizer.json``, a
``tokenizer_config.json`` and a ChatML chat template with tools + thinking, and answers
``Generate`` by streaming the token ids of a scripted text: the first ``Script`` whose
``trigger`` occurs in the decoded prompt wins (else ``default_text``). Scripts can also
delay admission, fail with a gRPC status, report cached tokens, or hang until cancelled.

The server runs on grpc's thread pool inside the test process, so a test can start it,
point a gateway process at ``address`` and read ``requests`` / ``cancelled`` /
``stream_closed`` afterwards. ``stop()`` shuts it down; ``restart()`` comes back on the
same port (a fresh ``engine_id``), which is what the gateway's reconnect logic sees.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
import uuid
from dataclasses import dataclass, field

import grpc

from deepwell import grpcx
from deepwell.engine.v1 import engine_pb2, engine_pb2_grpc

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
EOS_TOKEN = "<|im_end|>"

# ChatML with a Hermes-style <tools> block, reasoning_content and enable_thinking:
# enable_thinking=true opens <think> in the prompt (Qwen3.5 style), false closes an empty one.
CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions.\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\nReturn calls as <tool_call>\\n{\"name\": <name>, \"arguments\": <args>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'user' or message.role == 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message.content or '' }}"
    "{%- for tc in message.tool_calls or [] %}"
    "{%- set f = tc.function if tc.function is defined else tc %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}"
    "{%- if f.arguments is string %}{{- f.arguments }}{%- else %}{{- f.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is true %}{{- '<think>\\n' }}"
    "{%- elif enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)

_CORPUS = [
    "Hello! How can I help you today? The weather in Paris is sunny and 22 degrees.",
    "def main():\n    print('hello world')\n    return 0\n",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "You are a helpful assistant. user assistant system tool tools function parameter",
    "The quick brown fox jumps over the lazy dog. 0123456789 ,.;:!?()[]{}<>/\\|@#$%^&*-_=+",
]


@functools.cache
def tokenizer_json() -> str:
    """A small byte-level BPE tokenizer (covers every string) serialized as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer)
    tok.add_tokens(ADDED_TOKENS)
    return tok.to_str()


def load_tokenizer():  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json())


@dataclass
class Script:
    trigger: str
    text: str = ""
    finish: str = "stop"  # stop | length | error
    chunk: int = 1  # tokens per TokenChunk
    admit_delay_s: float = 0.0
    token_delay_s: float = 0.0
    error_code: str = ""  # e.g. "RESOURCE_EXHAUSTED": fail the call with this status
    error_message: str = ""
    hang: bool = False  # after the text, wait until the client goes away
    cached: int = 0  # tokens reported as resident_frontier hits


@dataclass
class FakeEngine:
    scripts: list[Script] = field(default_factory=list)
    default_text: str = "Hello! How can I help you today?"
    model_id: str = "fake-model"
    model_type: str = "qwen3"
    max_context: int = 4096
    chat_template: str = CHATML_TOOLS_TEMPLATE
    offer_files: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json")
    requests: list[engine_pb2.GenerateRequest] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    stream_closed: list[str] = field(default_factory=list)
    metadata_request_ids: list[str | None] = field(default_factory=list)  # x-request-id per Generate
    port: int = 0

    def __post_init__(self) -> None:
        self.tokenizer = load_tokenizer()
        self.eos_id = self.tokenizer.token_to_id(EOS_TOKEN)
        self.engine_id = uuid.uuid4().hex[:12]
        self._server: grpc.Server | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    # ---------------------------------------------------------------- files
    def files(self) -> dict[str, bytes]:
        cfg = {"bos_token": None, "eos_token": EOS_TOKEN, "pad_token": "<|endoftext|>",
               "chat_template": self.chat_template}
        all_files = {"tokenizer.json": tokenizer_json().encode(), "tokenizer_config.json": json.dumps(cfg).encode()}
        return {k: v for k, v in all_files.items() if k in self.offer_files}

    def info(self) -> engine_pb2.ModelInfo:
        files = [engine_pb2.ModelFile(name=k, size=len(v), sha256=hashlib.sha256(v).hexdigest())
                 for k, v in self.files().items()]
        return engine_pb2.ModelInfo(
            model_id=self.model_id, architecture="FakeForCausalLM", model_type=self.model_type,
            max_context_tokens=self.max_context, kv_dtype="bf16", vocab_size=self.tokenizer.get_vocab_size(),
            eos_token_ids=[self.eos_id], chat_template=self.chat_template, eos_token=EOS_TOKEN, files=files,
            page_size=64, max_concurrency=8, engine_id=self.engine_id, version="test",
        )

    def script_for(self, prompt_text: str) -> Script:
        for s in self.scripts:
            if s.trigger in prompt_text:
                return s
        return Script(trigger="", text=self.default_text)

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> FakeEngine:
        """Serve with grpc's thread-pool server (an aio server on a non-main thread of a
        process does not flush its streams reliably)."""
        from concurrent import futures

        from grpc_health.v1 import health, health_pb2, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=32), options=grpcx.message_options())
        engine_pb2_grpc.add_EngineServicer_to_server(_Servicer(self), server)
        hs = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        name = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name
        reflection.enable_server_reflection([name, reflection.SERVICE_NAME], server)
        port = server.add_insecure_port(f"127.0.0.1:{self.port}")
        if port == 0:
            raise OSError(f"fake engine could not bind 127.0.0.1:{self.port}")
        self.port = port
        server.start()
        hs.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        return self

    def stop(self) -> None:
        server = getattr(self, "_server", None)
        if server is not None:
            server.stop(0).wait(10)
            self._server = None

    def restart(self) -> FakeEngine:
        """Stop and start again on the same port with a new engine id."""
        self.stop()
        self.engine_id = uuid.uuid4().hex[:12]
        return self.start()

    def __enter__(self) -> FakeEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Servicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, fake: FakeEngine) -> None:
        self.fake = fake

    def Generate(self, request, context):  # noqa: N802
        rid = request.request_id or uuid.uuid4().hex
        self.fake.requests.append(request)
        self.fake.metadata_request_ids.append(dict(context.invocation_metadata()).get("x-request-id"))
        try:
            yield from self._generate(request, rid, context)
        except GeneratorExit:  # the server closed the stream: the client went away
            self.fake.stream_closed.append(rid)
            raise

    def _generate(self, request, rid, context):
        fake = self.fake
        prompt_text = fake.tokenizer.decode(list(request.prompt_token_ids), skip_special_tokens=False)
        script = fake.script_for(prompt_text)
        if script.error_code:
            context.abort(getattr(grpc.StatusCode, script.error_code), script.error_message or script.error_code)
        if not request.prompt_token_ids:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids is empty")
        if script.admit_delay_s:
            time.sleep(script.admit_delay_s)
        ids = fake.tokenizer.encode(script.text, add_special_tokens=False).ids
        limit = request.sampling.max_tokens or fake.max_context - len(request.prompt_token_ids)
        finish = script.finish
        if len(ids) > limit:
            ids, finish = ids[:limit], "length"
        cached = engine_pb2.CacheHits(resident_frontier=script.cached)
        yield engine_pb2.GenerateResponse(admitted=engine_pb2.Admitted(
            request_id=rid, prompt_tokens=len(request.prompt_token_ids), cached=cached, max_tokens=limit))
        for i in range(0, len(ids), max(1, script.chunk)):
            if script.token_delay_s:
                time.sleep(script.token_delay_s)
            yield engine_pb2.GenerateResponse(tokens=engine_pb2.TokenChunk(token_ids=ids[i:i + script.chunk]))
        if script.hang:
            # Empty chunks keep writing to the stream, so a cancelled call is noticed at once
            # (the server then closes this generator); they carry no tokens.
            while True:
                time.sleep(0.05)
                yield engine_pb2.GenerateResponse(tokens=engine_pb2.TokenChunk())
        reason = {"stop": engine_pb2.FINISH_REASON_STOP, "length": engine_pb2.FINISH_REASON_LENGTH,
                  "error": engine_pb2.FINISH_REASON_ERROR, "cancelled": engine_pb2.FINISH_REASON_CANCELLED,
                  "deadline": engine_pb2.FINISH_REASON_DEADLINE}[finish]
        usage = engine_pb2.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=len(ids),
                                 cached=cached)
        fin = engine_pb2.Finished(reason=reason, usage=usage,
                                  timings=engine_pb2.Timings(queue_ms=1.0, prefill_ms=2.0, decode_ms=3.0, ttft_ms=3.0),
                                  error={"error": "scripted engine error",
                                         "cancelled": "engine shutting down"}.get(finish, ""))
        if finish == "stop":
            fin.stop_token_id = fake.eos_id
        yield engine_pb2.GenerateResponse(finished=fin)

    def Cancel(self, request, context):  # noqa: N802
        self.fake.cancelled.append(request.request_id)
        return engine_pb2.CancelResponse(found=True)

    def GetModelInfo(self, request, context):  # noqa: N802
        return self.fake.info()

    def ReadModelFile(self, request, context):  # noqa: N802
        files = self.fake.files()
        if request.name not in files:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no file {request.name!r}")
        data = files[request.name]
        step = 1024  # several chunks, so the client reassembles them
        for off in range(0, max(len(data), 1), step):
            yield engine_pb2.FileChunk(offset=off, data=data[off:off + step], last=off + step >= len(data))

    def Stats(self, request, context):  # noqa: N802
        return engine_pb2.EngineStats(requests_finished=len(self.fake.requests), device="fake")


# ---------------------------------------------------------------------- gateway process
@dataclass
class GatewayProcess:
    """A live ``python -m deepwell.gateway`` subprocess on free ports (HTTP + gRPC Chat)."""

    proc: object
    http_port: int
    grpc_port: int
    log_path: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log_text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def alive(self) -> bool:
        return self.proc.poll() is None  # type: ignore[attr-defined]

    def stop(self) -> None:
        import subprocess

        p = self.proc
        if p.poll() is None:  # type: ignore[attr-defined]
            p.terminate()  # type: ignore[attr-defined]
            try:
                p.wait(10)  # type: ignore[attr-defined]
            except subprocess.TimeoutExpired:
                p.kill()  # type: ignore[attr-defined]
                p.wait(5)  # type: ignore[attr-defined]


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the test process dies (Linux), so no gateway leaks."""
    import ctypes
    import signal
    import sys

    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_gateway(engines: list[str], tmp_dir: str, *extra: str, wait_healthy: bool = True,
                  timeout_s: float = 60.0) -> GatewayProcess:
    """Start the gateway process; wait until it listens (and, by default, is healthy)."""
    import os
    import subprocess
    import sys
    import time
    import urllib.request
    from pathlib import Path

    port_file = Path(tmp_dir) / f"gw-port-{uuid.uuid4().hex[:6]}"
    log_path = str(Path(tmp_dir) / f"gw-{uuid.uuid4().hex[:6]}.log")
    grpc_port = free_port()
    cmd = [sys.executable, "-m", "deepwell.gateway", "--port", "0", "--port-file", str(port_file),
           "--engines", ",".join(engines), "--grpc-listen", f"127.0.0.1:{grpc_port}",
           "--health-interval-s", "0.2", *extra]
    env = {**os.environ, "DEEPWELL_LOG_JSON": "1"}
    log_file = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)
    gw = GatewayProcess(proc=proc, http_port=0, grpc_port=grpc_port, log_path=log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited with {proc.returncode}:\n{gw.log_text()[-4000:]}")
        if port_file.exists() and port_file.read_text().strip():
            gw.http_port = int(port_file.read_text())
            break
        time.sleep(0.05)
    else:
        gw.stop()
        raise RuntimeError(f"gateway did not start:\n{gw.log_text()[-4000:]}")
    while wait_healthy and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(gw.url + "/health", timeout=2) as r:
                if r.status == 200:
                    return gw
        except OSError:
            pass
        time.sleep(0.05)
    if wait_healthy:
        gw.stop()
        raise RuntimeError(f"gateway never became healthy:\n{gw.log_text()[-4000:]}")
    return gw


def read_sse(lines) -> list[tuple[str | None, object]]:
    """Parse SSE lines into ``(event, data)``; comments become ``(":", text)``; JSON data is
    decoded (``[DONE]`` stays a string)."""
    out: list[tuple[str | None, object]] = []
    event: str | None = None
    data: list[str] = []
    for line in lines:
        if line.startswith(":"):
            out.append((":", line[1:].strip()))
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())
        elif line == "":
            if data:
                text = "\n".join(data)
                out.append((event, text if text == "[DONE]" else json.loads(text)))
            event, data = None, []
    if data:
        text = "\n".join(data)
        out.append((event, text if text == "[DONE]" else json.loads(text)))
    return out


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]},
    },
}
