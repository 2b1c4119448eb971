"""flash_ext inside other libraries. Each integration is its own module, imported explicitly
(``import flash_ext.integrations.transformers``), so that ``import flash_ext`` never imports them
or the libraries they serve."""
