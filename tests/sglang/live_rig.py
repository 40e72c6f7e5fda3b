"""Real SGLang 0.5.23 servers on this CPU, for the ``sglang_server`` tests.

- ``write_tiny_llama(dir)``: a tiny random Llama checkpoint (safetensors, ``config.json``,
  ``generation_config.json``) and an offline tokenizer (``tokenizers``' BPE trained on a few
  lines, ``tokenizer.json`` + a chat template) — everything ``sglang.launch_server`` and our
  ``--model-path`` tokenizer read, made without a network.
- ``server_env()``: the environment an SGLang process needs here: ``tests/sglang/cpu_shim``
  (CPU TEST SHIM: the torchvision import stub through ``sitecustomize``, and the one vLLM
  rotary op SGLang imports off CUDA) on ``PYTHONPATH``, and one OpenMP thread per server.
- ``SGLangServer``: ``python -m sglang.launch_server`` on loopback with the flags that make it
  run on a CPU (``--device cpu --max-total-tokens --skip-server-warmup``), started, waited
  for (``/health``), stopped (its whole process group) — its log kept for failures.

Nothing here is on a GPU path: ``python -m sgl_fair.launch --backend sglang`` on a GPU never
sees the shim.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
SHIM = HERE / "cpu_shim"
CPU_FLAGS = ("--device", "cpu", "--max-total-tokens", "20000", "--skip-server-warmup")

_CORPUS = [
    "Once upon a time there was a tiny model that served many tenants fairly.",
    "The quick brown fox jumps over the lazy dog while the scheduler admits requests.",
    "Fairness means no tenant, however many or long its requests, starves the others.",
    "Prefix caching keeps the shared system prompt resident on the same worker.",
    "Hello world! What is the answer? It is forty two, of course; and then some more.",
    "user assistant system: you are a helpful assistant. Please answer the question.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 q a b c d e f g h i j k l m n o p",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tiny_llama(path: Path, *, seed: int = 0, layers: int = 2, hidden: int = 64) -> Path:
    """A random Llama (hidden 64, 2 layers, 4 heads, 2 KV heads, float32) in ``path``."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    special = ["<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=1000, special_tokens=special, initial_alphabet=alphabet
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    tok.save(str(path / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                "model_max_length": 4096, "chat_template": CHAT_TEMPLATE,
            }
        )
    )  # fmt: skip
    (path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )
    heads, kv_heads, inter = 4, 2, 4 * hidden
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "vocab_size": vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32",
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    g = torch.Generator().manual_seed(seed)
    head_dim = hidden // heads

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.05

    weights = {
        "model.embed_tokens.weight": rand(vocab, hidden),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": rand(vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
        }
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    return path


def server_env(cores: str = "0", extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an SGLang process on this CPU (``cores``: the OpenMP binding, e.g.
    ``"0"`` or ``"0|1"`` for two servers started by one launcher)."""
    env = dict(os.environ)
    path = [str(SHIM), str(HERE), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    env["SGLANG_CPU_OMP_THREADS_BIND"] = cores
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.pop("SGLFAIR_SCHEDULE_POLICY", None)
    env.pop("SGLFAIR_SCHEDULE_POLICY_OPTS", None)
    env.update(extra or {})
    return env


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SGLangServer:
    """One ``sglang.launch_server`` on loopback; a context manager."""

    def __init__(
        self,
        model: Path,
        log_path: Path,
        *,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 240.0,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.argv = [
            sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
            "--host", "127.0.0.1", "--port", str(self.port), *CPU_FLAGS, *args,
        ]  # fmt: skip
        self.env = server_env() if env is None else env
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None

    def start(self) -> SGLangServer:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SGLang server exited ({self.proc.returncode}):\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"SGLang server not healthy in {self.startup_timeout_s}s:\n{self.log()}")

    def log(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def __enter__(self) -> SGLangServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":  # make demo-sglang: write the tiny model into the folder given
    print(write_tiny_llama(Path(sys.argv[1])))


async def until_loads(
    http: httpx.AsyncClient, url: str, field: str, n: int, timeout_s: float = 30.0
) -> None:
    """Until the SGLang server at ``url`` counts ``n`` requests in ``field`` of its
    ``/v1/loads`` (``num_waiting_reqs``, ``num_running_reqs``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = await http.get(url + "/v1/loads?include=core", timeout=10)
        if sum(int(x.get(field, 0)) for x in r.json()["loads"]) >= n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"SGLang never had {n} requests in {field}")


async def until_queued(http: httpx.AsyncClient, url: str, n: int, timeout_s: float = 30.0) -> None:
    """Until the SGLang server at ``url`` holds ``n`` requests waiting (its ``/v1/loads``)."""
    await until_loads(http, url, "num_waiting_reqs", n, timeout_s)


async def generate(
    http: httpx.AsyncClient, url: str, client: str, n_out: int, tag: object, params=None
):
    """One ``/generate`` of ``n_out`` tokens for ``client`` (its ``routing_key``;
    ``params``: its ``custom_params``, as our bridge sends them); returns ``(client, when it
    ended, the response)``."""
    body = {
        "text": f"Once upon a time {client} {tag}",
        "sampling_params": {"max_new_tokens": n_out, "ignore_eos": True, "temperature": 0},
        "routing_key": client,
    }
    if params is not None:
        body["sampling_params"]["custom_params"] = params
    r = await http.post(url + "/generate", json=body, timeout=300)
    return client, time.monotonic(), r
