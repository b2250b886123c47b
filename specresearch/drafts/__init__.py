"""Draft models: n-gram lookup, distilled LMs, feature heads (EAGLE-3 style), dial drafts, and the registry by name."""
