"""Publishing helpers: model card and privacy.json for DP-trained models."""

from .card import parse_front_matter, render_model_card, template_source, write_privacy_artifacts

__all__ = ["render_model_card", "write_privacy_artifacts", "parse_front_matter", "template_source"]
