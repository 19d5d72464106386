/* Test-only reader for the vector files in tests/vectors: one vector object per line, string values without escapes. */
#ifndef VECTORS_JSON_H
#define VECTORS_JSON_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>

/* Copy the string value of "key" on this line into out; 0 when found. */
static int json_string(const char *line, const char *key, char *out, size_t cap)
{
    char pattern[64];
    const char *at, *end;
    snprintf(pattern, sizeof pattern, "\"%s\": \"", key);
    at = strstr(line, pattern);
    if (at == NULL) {
        return -1;
    }
    at += strlen(pattern);
    end = strchr(at, '"');
    if (end == NULL || (size_t)(end - at) >= cap) {
        return -1;
    }
    memcpy(out, at, (size_t)(end - at));
    out[end - at] = '\0';
    return 0;
}

static int hex_value(char c)
{
    if (c >= '0' && c <= '9') {
        return c - '0';
    }
    if (c >= 'a' && c <= 'f') {
        return c - 'a' + 10;
    }
    return -1;
}

/* Hex text to bytes; returns the byte count or -1. */
static long unhex(const char *hex, uint8_t *out, size_t cap)
{
    size_t n = strlen(hex), i;
    if (n % 2 != 0 || n / 2 > cap) {
        return -1;
    }
    for (i = 0; i < n / 2; i++) {
        int hi = hex_value(hex[2 * i]), lo = hex_value(hex[2 * i + 1]);
        if (hi < 0 || lo < 0) {
            return -1;
        }
        out[i] = (uint8_t)(hi * 16 + lo);
    }
    return (long)(n / 2);
}

#endif
