"""Models: where they come from and how they load (`loading`: the tiny model and tokenizer, named
models and GGUF files converted once to a cached folder, pretrained models), received model folders
checked (`files`), LoRA (`lora`)."""
