"""The error every part of pipeline execution raises (transport, executor, logging adapter), so a caller catches
one type whichever part found the problem."""


class PipelineError(RuntimeError):
    """A pipeline step cannot run as the model and batch are."""
