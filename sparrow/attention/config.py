"""What sparse attention does, independent of the schedule that sets its budget."""

from __future__ import annotations

from dataclasses import dataclass

from sparrow.errors import SparrowError

from .landmarks import Landmark, get_landmark


@dataclass(frozen=True)
class SparseConfig:
    """Block-sparse attention settings (SPEC section 3); defaults are the release's.

    page_size: tokens per KV page. sink_pages / recent_pages: pages always attended at the start and end of the
    cache. dense_layers: layer indices that always attend densely. landmark: the name of a page landmark in
    landmarks.REGISTRY, `centroid` (mean key per page, scored with the group-mean query) or `quest` (per-channel
    min/max keys, upper-bound score maximized over the group).
    """

    page_size: int = 16
    sink_pages: int = 1
    recent_pages: int = 2
    dense_layers: tuple[int, ...] = (0, 1)
    landmark: str = "centroid"

    def __post_init__(self):
        if self.page_size < 1:
            raise SparrowError(f"page_size must be a positive integer, got {self.page_size}")
        if self.sink_pages < 0 or self.recent_pages < 1:
            raise SparrowError(
                "need sink_pages >= 0 and recent_pages >= 1 (the current page), "
                f"got {self.sink_pages}, {self.recent_pages}"
            )
        get_landmark(self.landmark)
        object.__setattr__(self, "dense_layers", tuple(int(i) for i in self.dense_layers))

    @classmethod
    def from_options(cls, page_size: int, landmark: str, dense_layers: str) -> SparseConfig:
        """Build from command-line / YAML values, where dense layers are a comma-separated string like '0,1'."""
        try:
            layers = tuple(int(x) for x in str(dense_layers).split(",") if x.strip())
        except ValueError:
            raise SparrowError(f"dense_layers must be comma-separated integers, got {dense_layers!r}") from None
        return cls(page_size=page_size, landmark=landmark, dense_layers=layers)

    @property
    def always_kept_pages(self) -> int:
        """Pages every sparse step attends whatever their scores: the sink pages and the most recent ones."""
        return self.sink_pages + self.recent_pages

    @property
    def page_landmark(self) -> Landmark:
        """The registry entry of `landmark`: how pages are summarised and scored, and what that costs."""
        return get_landmark(self.landmark)
