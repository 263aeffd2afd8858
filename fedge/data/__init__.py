"""Data on the host: datasets, their partition across clients, and training-data augmentation."""
