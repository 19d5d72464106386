/* Empty: the size estimate compiles for a bare Cortex-M4; libsodium headers include this but need nothing from it. */
