/* modelslot storage on an ESP-IDF flash partition (a data partition of 2 x 4 KiB + 2 x slot size). */
#ifndef PARTITION_STORAGE_H
#define PARTITION_STORAGE_H

#include "esp_partition.h"
#include "modelslot.h"

/* Bind `out` to the partition labelled `label`; returns ESP_OK or ESP_ERR_NOT_FOUND. */
esp_err_t partition_storage_bind(const char *label, ms_storage *out, const esp_partition_t **partition);

#endif
