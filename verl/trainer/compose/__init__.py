"""Composition: the parts a trainer is built from (`components`), the runtime around it and the training loop every
trainer kind shares."""
