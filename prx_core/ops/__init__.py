"""What an operator runs beside the stages: checks of the machine and the store (`doctor`), the
corpus summary a build prints (`summary`), compaction of the whole corpus (`compaction`)."""
