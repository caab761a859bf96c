"""Model architectures the runtime executes (Llama family)."""
