"""Trained scorers on the decoder: Bradley-Terry reward models (`bradley_terry`), process
reward models (`prm`), the Monte-Carlo step labels PRMs learn from (`step_labels`), and what
the two heads share (`scalar_head`)."""
