"""The tokenizer service: client requests in, tokenized requests to the scheduler, text out."""
