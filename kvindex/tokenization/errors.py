"""Why a prompt cannot be rendered locally (shared by the renderer and the converters)."""


class UnsupportedPrompt(ValueError):
    """The local renderer cannot reproduce the engine for this request."""
