#include "partition_storage.h"

static int part_read(void *ctx, uint32_t addr, uint8_t *buf, uint32_t len)
{
    return esp_partition_read((const esp_partition_t *)ctx, addr, buf, len) == ESP_OK ? 0 : -1;
}

static int part_write(void *ctx, uint32_t addr, const uint8_t *buf, uint32_t len)
{
    return esp_partition_write((const esp_partition_t *)ctx, addr, buf, len) == ESP_OK ? 0 : -1;
}

static int part_erase(void *ctx, uint32_t addr, uint32_t len)
{
    return esp_partition_erase_range((const esp_partition_t *)ctx, addr, len) == ESP_OK ? 0 : -1;
}

esp_err_t partition_storage_bind(const char *label, ms_storage *out, const esp_partition_t **partition)
{
    const esp_partition_t *p = esp_partition_find_first(ESP_PARTITION_TYPE_DATA, ESP_PARTITION_SUBTYPE_ANY, label);
    if (p == NULL) {
        return ESP_ERR_NOT_FOUND;
    }
    out->ctx = (void *)p;
    out->read = part_read;
    out->write = part_write;
    out->erase = part_erase;
    *partition = p;
    return ESP_OK;
}
