"""Adapters trained by ``run`` and pushed to a registry, served by name by vLLM (CPU build) through
the resolver plugin: one OpenAI-compatible server (``vllm serve BASE --enable-lora`` with runtime
LoRA loading) answers every check, since each vLLM start costs about a minute on 2 cores.

- greedy completions of the quickstart adapter trained in one process, with tp=2 and with pp=2
  (each pushed to a local registry) equal transformers + peft ``generate`` token for token; the
  base model's too, and the adapters change the answers;
- a version pushed to the moto S3 server after the server started is served by tag;
- a version whose stored weights were altered is refused (400, the reason in the response and the
  server log) and nothing of it is cached; unknown and malformed names get their reason too;
- the cached copies vLLM reads again: a byte flipped in one, then the whole cache removed by hand,
  while the server runs; adapters evicted from vLLM's CPU cache (``--max-loras 2``) and asked for
  again are read from verified copies (the answers stay PEFT's, the server stays up);
- a tag moved while the server runs: the name keeps its version until unloaded, then follows the tag;
- ``NAME`` and ``NAME:VERSION`` of one version take one LoRA slot (nothing is read again while
  cycling through them and another adapter with 2 slots).

These run in file order on the one server; the last ones alter its cache.
"""

from __future__ import annotations

import json
import shutil
import stat
import urllib.request
import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from nxd_finetune.registry import push  # noqa: E402
from tests.vllm.serving import (  # noqa: E402
    EVAL_ROWS,
    ROOT,
    Greedy,
    assert_same,
    chat_prompts,
    complete,
    peft_greedy,
    spawn_env,
    train,
    vllm_server,
)

QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
TRAIN = ["training.max_steps=40", "eval.every_n_steps=null", "checkpoint.every_n_steps=null", "logging.progress=false"]
LAYOUTS = {
    "single": [],
    "tp2": ["parallel.nproc=2", "parallel.tp=2"],
    "pp2": ["parallel.nproc=2", "parallel.pp=2", "training.grad_accum=2"],
}
BUCKET = "nxd-test"


@pytest.fixture(scope="module")
def base_dir(quickstart_cache) -> Path:
    from nxd_finetune.data.inputs import resolve_model_dir

    return resolve_model_dir("builtin:tiny-llama")


@pytest.fixture(scope="module")
def adapters(work) -> dict[str, Path]:
    """The quickstart adapter trained by the CLI in each layout: ``{layout: final adapter dir}``."""
    return {layout: train(work, QUICKSTART, work / "runs" / layout, *TRAIN, *overrides)
            for layout, overrides in LAYOUTS.items()}


@pytest.fixture(scope="module")
def prompts(base_dir) -> list[list[int]]:
    """Token ids of eval questions rendered with the chat template (the generation prompt added)."""
    return chat_prompts(base_dir)


@pytest.fixture(scope="module")
def expected(base_dir, adapters, prompts) -> dict[str, Greedy]:
    """transformers + peft greedy ``generate`` for the base model and for each layout's adapter."""
    return peft_greedy(base_dir, adapters, prompts)


@pytest.fixture(scope="module")
def registries(work, adapters, moto_s3) -> dict[str, str]:
    """A local registry holding every layout's adapter and a corrupted version, and an empty S3 one."""
    local, s3 = str(work / "registry"), f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
    for layout, path in adapters.items():
        push(path, f"{local}/qs-{layout}")
    push(adapters["single"], f"{local}/broken")
    weights = Path(local) / "broken/1/adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte of a LoRA tensor, same size
    weights.write_bytes(bytes(data))
    return {"local": local, "s3": s3}


@pytest.fixture(scope="module")
def server(work, base_dir, registries):
    """One ``vllm serve BASE --enable-lora`` with runtime LoRA loading and the resolver on both
    registries; yields ``(openai client, log path)``."""
    log = work / "vllm-server.log"
    env = spawn_env(
        work,
        NXD_FINETUNE_LORA_REGISTRY=f"{registries['local']},{registries['s3']}",
        NXD_FINETUNE_LORA_CACHE=str(work / "lora-cache"),
        VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
    )
    env.pop("VLLM_PLUGINS", None)  # every general plugin, ours included
    with vllm_server(base_dir, work, log, ["--max-loras", "2"], env) as client:
        yield client, log


def test_adapters_of_every_layout_serve_like_peft(server, base_dir, prompts, expected):
    client, log = server
    assert_same(complete(client, str(base_dir), prompts), expected["base"], "base")
    for layout in LAYOUTS:
        assert expected[layout].ids != expected["base"].ids, layout  # the adapter changes the answers
        assert_same(complete(client, f"qs-{layout}:1", prompts), expected[layout], layout)
    assert_same(complete(client, "qs-single", prompts), expected["single"], "latest")
    assert "serving 'qs-tp2:1' as" in log.read_text()


def test_chat_answer_is_peft_answer(server, base_dir, prompts, expected):
    """The chat API renders the base's chat template and stops at EOS: the answer PEFT gives."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_dir)
    row = json.loads(EVAL_ROWS.read_text().splitlines()[0])
    client, _ = server
    resp = client.chat.completions.create(model="qs-single:1", messages=row["messages"][:-1], max_tokens=8,
                                          temperature=0)
    want = expected["single"].ids[0]
    want = want[: want.index(tok.eos_token_id)] if tok.eos_token_id in want else want
    assert resp.choices[0].message.content == tok.decode(want, skip_special_tokens=True) != ""


def test_version_pushed_to_s3_serves_by_tag(server, registries, adapters, prompts, expected, work):
    client, log = server
    with pytest.raises(openai.NotFoundError):
        complete(client, "qs-s3-pp2@prod", prompts)  # not pushed yet
    version = push(adapters["pp2"], f"{registries['s3']}/qs-s3-pp2", tags=["prod"])
    assert_same(complete(client, "qs-s3-pp2@prod", prompts), expected["pp2"], "s3")
    assert f"as {version.ref}" in log.read_text()
    cached = [p.parent for p in (work / "lora-cache").rglob("adapter_model.safetensors") if "qs-s3-pp2" in str(p)]
    assert len(cached) == 1
    assert (cached[0] / "adapter_model.safetensors").read_bytes() == (
        adapters["pp2"] / "adapter_model.safetensors"
    ).read_bytes()


def test_refusals_give_their_reason(server, prompts, work):
    client, log = server
    for model, status, reason in (
        ("broken:1", 400, "LoRA adapter refused: broken:1: adapter_model.safetensors does not match its manifest"),
        ("qs-single:7", 404, "qs-single:7 does not exist (versions: 1)"),
        ("qs-single@nope", 404, "qs-single has no tag 'nope'"),
        ("nobody", 404, "The model `nobody` does not exist: no adapter 'nobody' in the served registries."),
        ("qs-single:0", 404, "The model `qs-single:0` does not exist: invalid version '0'"),
    ):
        with pytest.raises(openai.APIStatusError) as e:
            complete(client, model, prompts)
        assert e.value.status_code == status and reason in e.value.message, (model, e.value.message)
    text = log.read_text()
    assert "refused LoRA adapter 'broken:1'" in text
    assert "broken:1: adapter_model.safetensors does not match its manifest" in text
    assert not [p for p in (work / "lora-cache").rglob("*") if "broken" in p.parts and p.is_file()]


def _loads(log: Path) -> int:
    """How many times vLLM has read a cached copy's files (the plugin logs each checked load)."""
    return log.read_text().count("nxd-finetune registry: loading LoRA adapter")


def test_names_of_one_version_take_one_slot(server, prompts, expected):
    """``qs-tp2`` and ``qs-tp2:1`` share one adapter id: cycling through them and ``qs-pp2:1`` fits
    vLLM's CPU cache of 2 (three ids would evict one at every request and read its files again)."""
    client, log = server
    cycle = (("qs-tp2:1", "tp2"), ("qs-tp2", "tp2"), ("qs-pp2:1", "pp2"))
    for name, layout in cycle:
        assert_same(complete(client, name, prompts), expected[layout], name)
    assert "'qs-tp2' takes the LoRA slot of 'qs-tp2:1'" in log.read_text()
    loads = _loads(log)
    for _ in range(2):
        for name, layout in cycle:
            assert_same(complete(client, name, prompts), expected[layout], name)
    assert _loads(log) == loads


def _copy_of(log: Path, name: str) -> Path:
    """The cached copy the server's log says it serves ``name`` from."""
    line = [ln for ln in log.read_text().splitlines() if f"serving {name!r} as" in ln][-1]
    return Path(line.rsplit(" from ", 1)[1].strip())


def _evict_and_ask_again(client, name: str, others: list[str], prompts) -> Greedy:
    """Ask for ``name``, then for two other adapters (vLLM's CPU cache holds 2: ``name`` is evicted),
    then for ``name`` again: vLLM reads its files again from the path the resolver gave."""
    complete(client, name, prompts)
    for other in others:
        complete(client, other, prompts)
    return complete(client, name, prompts)


def test_a_flipped_byte_in_a_cached_copy_is_never_served(server, prompts, expected):
    client, log = server
    assert_same(complete(client, "qs-single:1", prompts), expected["single"], "before")
    copy = _copy_of(log, "qs-single:1")
    weights = copy / "adapter_model.safetensors"
    assert stat.S_IMODE(weights.stat().st_mode) == 0o444  # not writable in place (root writes anyway)
    weights.chmod(0o644)
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # the sign and exponent byte of the last weight
    weights.write_bytes(bytes(data))

    got = _evict_and_ask_again(client, "qs-single:1", ["qs-tp2:1", "qs-pp2:1"], prompts)
    assert_same(got, expected["single"], "after a byte flipped in the cached copy")
    assert f"the cached copy {copy} is missing or altered; using {copy}.1" in log.read_text()
    assert weights.read_bytes() == bytes(data)  # left as it was: a server may read it again


def test_the_cache_removed_by_hand_does_not_take_the_server_down(server, prompts, expected, work):
    client, log = server
    shutil.rmtree(work / "lora-cache")
    assert_same(_evict_and_ask_again(client, "qs-tp2:1", ["qs-single:1", "qs-pp2:1"], prompts),
                expected["tp2"], "tp2 after rm -rf of the cache")
    assert_same(complete(client, "qs-single:1", prompts), expected["single"], "single after rm -rf of the cache")
    text = log.read_text()
    for name in ("qs-tp2:1", "qs-single:1"):
        assert f"the cached copy {_copy_of(log, name)} is missing or altered" in text, name
    assert_same(complete(client, "qs-single@latest", prompts), expected["single"], "a name resolved after")


def _unload(client, name: str) -> None:
    body = json.dumps({"lora_name": name}).encode()
    req = urllib.request.Request(f"{client.base_url}unload_lora_adapter", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200


def test_a_moved_tag_takes_effect_when_its_name_is_unloaded(server, registries, adapters, prompts, expected):
    client, log = server
    ref = f"{registries['local']}/qs-move"
    push(adapters["single"], ref, tags=["prod"])
    for name in ("qs-move@prod", "qs-move"):
        assert_same(complete(client, name, prompts), expected["single"], name)
    push(adapters["pp2"], ref, tags=["prod"])  # version 2: prod and latest move to it
    for name in ("qs-move@prod", "qs-move"):
        assert_same(complete(client, name, prompts), expected["single"], f"{name}: loaded names keep their version")
        _unload(client, name)
        assert_same(complete(client, name, prompts), expected["pp2"], f"{name}: resolved again after unloading")
    assert "serving 'qs-move@prod' as" in log.read_text() and f"{ref}:2 from" in log.read_text()
