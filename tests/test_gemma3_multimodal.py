"""Text-only fine-tuning of a Gemma 3 multimodal checkpoint (``Gemma3ForConditionalGeneration``)
against the `transformers` oracle: a tiny random one (tiny text and vision configs) saved with
``save_pretrained``; our language model gives its text-only logits (fp32), a LoRA run through the
CLI writes an adapter that `peft` loads onto the multimodal model with our logits and that leaves
the vision tower alone, ``validate`` counts the text part, ``merge`` and full SFT refuse in one line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig

from nxd_finetune.cli import main
from nxd_finetune.lora import LoraConfig, inject_lora, load_adapter, save_adapter
from nxd_finetune.models import DecoderConfig, build_model, load_pretrained
from nxd_finetune.models.config import GEMMA3_TEXT_DEFAULTS
from nxd_finetune.quickstart import ensure_tiny_model
from tests.model_helpers import num_parameters

REPO = Path(__file__).resolve().parents[1]
VOCAB = 2048  # the quickstart tokenizer's, so the CLI run can use it
TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=6, max_position_embeddings=256,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"])
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=28,
              patch_size=14)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_gemma3_mm(path: Path, seed: int = 0, **text) -> Path:
    """A random tiny ``Gemma3ForConditionalGeneration`` (norms perturbed) saved to ``path`` with the
    quickstart tokenizer beside it."""
    config = Gemma3Config(text_config={**TEXT, **text}, vision_config=VISION, mm_tokens_per_image=4,
                          image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
    model.save_pretrained(path)
    for f in ensure_tiny_model().iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            (path / f.name).write_bytes(f.read_bytes())
    return path


def hf_model(path: Path, attn: str = "eager") -> Gemma3ForConditionalGeneration:
    return Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32, attn_implementation=attn).eval()


def _ids(t: int = 24) -> torch.Tensor:
    return torch.randint(3, VOCAB - 4, (2, t), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def mm_dir(tmp_path_factory) -> Path:
    return make_gemma3_mm(tmp_path_factory.mktemp("gemma3-mm") / "model")


def test_transformers_saves_the_4x_layout(mm_dir):
    """What transformers 5 writes (and what we read first): ``language_model.model.*``, the vision
    tower and projector beside it, no ``lm_head`` (tied)."""
    with safe_open(mm_dir / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "language_model.model.layers.0.self_attn.q_proj.weight" in keys
    assert {k.split(".")[0] for k in keys} == {"language_model", "vision_tower", "multi_modal_projector"}
    assert not any(k.startswith("model.") or "lm_head" in k for k in keys)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_text_logits_match_transformers(mm_dir, attn):
    ours = load_pretrained(mm_dir).eval()
    assert ours.config.multimodal and ours.config.architecture == "Gemma3ForCausalLM"
    assert not any("vision" in n for n, _ in ours.named_parameters())
    ids = _ids()
    with torch.no_grad():
        diff = (ours(ids) - hf_model(mm_dir, attn)(input_ids=ids).logits).abs().max().item()
    assert diff <= 1e-5, diff


def test_module_name_layout_and_no_softcap_read_as_transformers_does(mm_dir, tmp_path):
    """The same weights under transformers' module names (``model.language_model.*``, untied
    ``lm_head``) load in both; ``final_logit_softcapping`` in ``text_config`` is ignored by
    transformers' multimodal head, and by us."""
    path = make_gemma3_mm(tmp_path / "untied", seed=2, final_logit_softcapping=0.5)
    raw = json.loads((path / "config.json").read_text())
    raw["tie_word_embeddings"] = False
    (path / "config.json").write_text(json.dumps(raw))
    tensors = load_file(path / "model.safetensors")
    renamed = {re.sub(r"^language_model\.model\.", "model.language_model.", k): v for k, v in tensors.items()}
    head = torch.randn(VOCAB, TEXT["hidden_size"], generator=torch.Generator().manual_seed(4))
    renamed["lm_head.weight"] = head * 0.1
    save_file(renamed, path / "model.safetensors", metadata={"format": "pt"})
    hf = hf_model(path)
    assert torch.equal(hf.lm_head.weight, renamed["lm_head.weight"])
    ours = load_pretrained(path).eval()
    ids = _ids()
    with torch.no_grad():
        assert (ours(ids) - hf(input_ids=ids).logits).abs().max() <= 1e-5


def test_sparse_text_config_takes_transformers_defaults():
    """A ``text_config`` naming a few keys (as the released 4b/12b/27b configs do, with the pre-5
    ``rope_scaling``): the missing ones are transformers' defaults; the parameter count is that of
    transformers' language model (tied head)."""
    defaults = Gemma3TextConfig()
    for key, value in GEMMA3_TEXT_DEFAULTS.items():
        if key not in ("rope_theta", "rope_local_base_freq"):
            assert getattr(defaults, key) == value, key
    assert defaults.rope_parameters["full_attention"]["rope_theta"] == GEMMA3_TEXT_DEFAULTS["rope_theta"]
    assert defaults.rope_parameters["sliding_attention"]["rope_theta"] == GEMMA3_TEXT_DEFAULTS["rope_local_base_freq"]
    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                             "model_type": "siglip_vision_model", "num_attention_heads": 16,
                             "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}
    config = DecoderConfig.from_hf(raw)
    text = Gemma3Config(**{k: v for k, v in raw.items() if k != "model_type"}).text_config
    for key in ("vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim", "query_pre_attn_scalar",
                "max_position_embeddings", "layer_types", "sliding_window", "tie_word_embeddings"):
        assert getattr(config, key) == getattr(text, key), key
    assert (config.rope_theta, config.rope_local_base_freq, config.rope_scaling["factor"]) == (1e6, 1e4, 8.0)
    assert text.rope_parameters["full_attention"]["factor"] == 8.0
    with torch.device("meta"):
        hf = Gemma3ForConditionalGeneration(Gemma3Config(**{k: v for k, v in raw.items() if k != "model_type"}))
    expected = sum(p.numel() for p in hf.model.language_model.parameters())
    assert num_parameters(config) == expected == sum(p.numel() for p in build_model(config).parameters())


def _adapter(ours, tmp_path: Path, targets, base: Path) -> Path:
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets)
    inject_lora(ours, cfg)
    torch.manual_seed(5)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return save_adapter(ours, cfg, tmp_path / "adapter", str(base))


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"], r".*\.layers\.1\.mlp\.(up|down)_proj"])
def test_adapter_loads_in_peft_on_the_multimodal_model(mm_dir, tmp_path, targets):
    """Our adapter under transformers' module names, targets restricted to the language model: `peft`
    wraps exactly our modules (none of the vision tower's) and gives our logits."""
    ours = load_pretrained(mm_dir).eval()
    adapter = _adapter(ours, tmp_path, targets, mm_dir)
    d = json.loads((adapter / "adapter_config.json").read_text())
    assert d["base_model_name_or_path"] == str(mm_dir)
    assert isinstance(d["target_modules"], str) and d["target_modules"].startswith(r"model\.language_model\.")
    with safe_open(adapter / "adapter_model.safetensors", "pt") as f:
        assert all(k.startswith("base_model.model.model.language_model.layers.") for k in f.keys())
    hf = hf_model(mm_dir)
    ids = _ids()
    with torch.no_grad():
        base = hf(input_ids=ids).logits
        peft = PeftModel.from_pretrained(hf, adapter).eval()
        ref = peft(input_ids=ids).logits
        diff = (ours(ids) - ref).abs().max().item()
    wrapped = {n.removeprefix("base_model.model.") for n, m in peft.named_modules() if hasattr(m, "lora_A")
               and not n.endswith(("lora_A", "lora_B"))}
    ours_wrapped = {"model.language_model." + n.removeprefix("model.") for n, m in ours.named_modules()
                    if hasattr(m, "lora_A") and not n.endswith(("lora_A", "lora_B"))}
    assert wrapped == ours_wrapped and not any("vision" in n for n in wrapped)
    assert diff <= 1e-5, diff
    assert (base - ref).abs().max() > 1e-3  # the adapter changes the logits
    again = load_pretrained(mm_dir).eval()  # and our loader reads it back (lora.init_from, generate)
    load_adapter(again, adapter)
    with torch.no_grad():
        assert (again(ids) - ref).abs().max() <= 1e-5


def _recipe_args(model: Path, data: Path, out: Path) -> list[str]:
    return [str(REPO / "recipes" / "quickstart.yaml"), f"model.path={model}", f"data.train={data}",
            f"data.eval={data}", "data.max_seq_len=32", "training.max_steps=2", "training.micro_batch_size=2",
            "training.warmup_steps=0", "eval.before=false", "eval.max_batches=1", "logging.progress=false",
            "lora.rank=4", f"output.dir={out}"]


@pytest.fixture
def chat_data(tmp_path) -> Path:
    data = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"is {n} even?"}, {"role": "assistant", "content": "yes"}]}
            for n in range(8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def test_lora_run_through_the_cli(mm_dir, chat_data, tmp_path, capsys, quickstart_cache):
    """``validate`` counts the language model; ``run`` trains LoRA and writes an adapter that
    `peft` loads onto the multimodal model, and a second run starts from it (``lora.init_from``)."""
    args = _recipe_args(mm_dir, chat_data, tmp_path / "out")
    with pytest.raises(SystemExit) as info:
        main(["validate", *args])
    out = capsys.readouterr()
    assert (info.value.code or 0) == 0, out.err
    total, trainable = (int(x.replace(",", "")) for x in
                        re.search(r"parameters: total ([\d,]+)\s+trainable ([\d,]+)", out.out).groups())
    hf = hf_model(mm_dir)
    h, i, layers = TEXT["hidden_size"], TEXT["intermediate_size"], TEXT["num_hidden_layers"]
    q, kv = 4 * 16, 2 * 16
    lora = layers * 4 * ((h + q) * 2 + (h + kv) * 2 + (h + i) * 2 + (i + h))
    assert trainable == lora
    assert total == sum(p.numel() for p in hf.model.language_model.parameters()) + lora
    with pytest.raises(SystemExit) as info:
        main(["run", *args])
    assert (info.value.code or 0) == 0, capsys.readouterr().err
    adapter = next((tmp_path / "out").rglob("adapter_config.json")).parent
    ids = _ids()
    with torch.no_grad():
        base = hf(input_ids=ids).logits
        ref = PeftModel.from_pretrained(hf, adapter).eval()(input_ids=ids).logits
    assert (base - ref).abs().max() > 0  # trained
    ours = load_pretrained(mm_dir).eval()
    load_adapter(ours, adapter)
    with torch.no_grad():
        assert (ours(ids) - ref).abs().max() <= 1e-5
    # lora.init_from reads its target regex back onto our module names
    with pytest.raises(SystemExit) as info:
        main(["run", *_recipe_args(mm_dir, chat_data, tmp_path / "again"), f"lora.init_from={adapter}"])
    assert (info.value.code or 0) == 0, capsys.readouterr().err


@pytest.mark.parametrize(("command", "needle"), [
    (["merge"], "merge supports text models only"),
    (["run", "lora=null"], "full fine-tuning of a multimodal checkpoint is not supported"),
    (["run", "checkpoint.save_mode=merged"], "checkpoint.save_mode=merged of a multimodal checkpoint"),
])
def test_merge_and_full_sft_refuse_in_one_line(mm_dir, chat_data, tmp_path, capsys, quickstart_cache, command, needle):
    if command[0] == "merge":
        ours = load_pretrained(mm_dir)
        adapter = _adapter(ours, tmp_path, "all-linear", mm_dir)
        argv = ["merge", "--adapter", str(adapter), "--base", str(mm_dir), "--out", str(tmp_path / "merged")]
    else:
        argv = ["run", *_recipe_args(mm_dir, chat_data, tmp_path / "out"), *command[1:]]
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert info.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], err
