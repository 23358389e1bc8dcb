"""After training: generate from a trained model (``generate``, ``chat``), score it on a recipe's
eval set (``eval``), and the generations logged at every eval of a run (``eval.prompts``).

Generation runs on HF ``transformers`` (``AutoModelForCausalLM`` + ``generate``) with the adapter
attached by ``peft`` (``PeftModel.from_pretrained``), so what a user sees here is what those
libraries (and vLLM, which loads the same files) produce.
"""
