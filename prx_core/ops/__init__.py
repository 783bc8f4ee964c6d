"""What an operator runs beside the stages: checks of the machine and the store (`doctor`)."""
