"""Building a role: its model (`models`), process and device setup, FSDP launch, mixed precision and optimizer."""
