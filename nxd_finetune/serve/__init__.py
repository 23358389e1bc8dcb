"""After training: generate from a trained model (``generate``, ``chat``), score it on a recipe's
eval set (``eval``), the generations logged at every eval of a run (``eval.prompts``), and the vLLM
LoRA resolver that serves registry adapters by name (``vllm_resolver``, ``lora_cache``).

Generation runs on HF ``transformers`` (``AutoModelForCausalLM`` + ``generate``) with the adapter
attached by ``peft`` (``PeftModel.from_pretrained``), so what a user sees here is what those
libraries (and vLLM, which loads the same files) produce.
"""
