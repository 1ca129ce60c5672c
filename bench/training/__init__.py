"""What the training scripts (scripts/train_*.py, scripts/draft_vocab.py) share: the frozen target and its
precision (target), the training text (corpus), the loss-curve plot (loss_curve)."""
