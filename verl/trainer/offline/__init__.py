"""Trainers on fixed data: SFT, DPO and reward models, over a shared base."""
