"""What a Hugging Face checkpoint folder brings: tokenizer, chat template, tools, weights."""
