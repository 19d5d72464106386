/*
 * The release key this MCU trusts: key id and Ed25519 public key of a minisign key, as in
 * `edgerun ota keygen`'s .pub file (base64 of "Ed" | key id (8) | public key (32)).
 * Replace these placeholder bytes at provisioning time.
 */
#ifndef RELEASE_KEY_H
#define RELEASE_KEY_H

#include "modelslot.h"

static const ms_key RELEASE_KEYS[] = {
    {{0, 0, 0, 0, 0, 0, 0, 0},
     {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}},
};

#endif
