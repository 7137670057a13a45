"""Models: building and loading them (`loading`: the tiny model and tokenizer, pretrained models),
named models and GGUF files (`packaged`), received model folders checked (`files`), LoRA (`lora`)."""
